"""OpenAPI: a scoped slug field documents itself as the slug field of its scope's model."""

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from rest_framework import serializers


class ScopedSlugRelatedFieldExtension(OpenApiSerializerFieldExtension):
    target_class = "portal.core.fields.ScopedSlugRelatedField"

    def map_serializer_field(self, auto_schema, direction):
        # The scope of no user is empty but typed: its model names the slug's model field, which
        # drf-spectacular maps as it maps any SlugRelatedField with a queryset.
        model = self.target.scope(None).model
        stand_in = serializers.SlugRelatedField(slug_field=self.target.slug_field,
                                                queryset=model._default_manager.none())
        return auto_schema._map_serializer_field(stand_in, direction)
