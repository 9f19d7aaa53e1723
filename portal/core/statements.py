"""Hot-path lookups whose SQL the ORM writes once per thread instead of once per request.

Building and compiling a queryset costs several hundred microseconds of Python each time
(cloning, resolving lookups, `as_sql`), more than PostgreSQL takes to run the prepared statement
it yields. Every API request authenticates its token, and every booking resolves its tenant
through the tenant scope and its pool: the same three query shapes, request after request,
with different values.

A `CompiledLookup` keeps the ORM as the only author of that SQL. `build(*values)` returns the
queryset exactly as the code would otherwise write it (scopes, annotations, select_related); it
is compiled once per thread and shape, twice over, with two different sets of *markers* standing
in for the values. The SQL text must come out identical and the parameters must differ exactly
where a marker went in, each unchanged: those positions are where later calls bind their values.
Anything else — a value the ORM inlined into the SQL text, transformed before binding
(`icontains` binds `%value%`), or judged out of the field's range (Django then compiles the
filter to nothing) — makes the lookup refuse to compile rather than run a wrong statement. Each
call then builds the model instances the way Django's `ModelIterable` does (the same
converters, select_related populators and annotations).

The *shape* of a queryset may depend on more than the bound values (a scope returns everything
to staff, nothing to the anonymous): callers pass a `shape` key holding whatever else `build`
branches on. The cache is per thread because a compiler belongs to its thread's connection.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Hashable
from typing import Any

from django.core.exceptions import EmptyResultSet, MultipleObjectsReturned
from django.db import connections
from django.db.models import Model, QuerySet
from django.db.models.query import get_related_populators
from django.utils.functional import LazyObject, empty

__all__ = ["CompiledLookup", "marker_for", "marker_user"]

# Two marker sets: ints inside PostgreSQL's integer range (Django compiles an out-of-range value
# to an empty filter, which the compile check then refuses), strings holding NUL (PostgreSQL text
# cannot, so no real value is ever a marker).
_INT_MARKERS = (2_146_000_000, 2_147_000_000)
_STR_MARKER = "\x00portal-marker-{}-{}\x00"


def marker_for(kind: type, index: int, variant: int = 0) -> Any:
    if kind is int:
        return _INT_MARKERS[variant] + index
    if kind is str:
        return _STR_MARKER.format(variant, index)
    raise TypeError(f"CompiledLookup values are int or str, not {kind.__name__}")


def marker_user(user: Any, pk: int) -> Any:
    """A copy of user whose pk is the marker pk, for scopes that take a user: everything else the
    scope may branch on (is_staff, is_authenticated) stays the caller's and goes into the shape."""
    if isinstance(user, LazyObject):  # request.user under session auth: copy the user, never the proxy
        if user._wrapped is empty:
            user._setup()
        user = user._wrapped
    stand_in = copy.copy(user)
    stand_in.pk = pk
    return stand_in


def _compile(queryset: QuerySet):
    query = queryset.query.chain()
    query.clear_ordering(force=True)  # as .get() does: one row needs no order
    query.set_limits(high=2)  # one row wanted; a second one means the lookup was not unique
    compiler = query.get_compiler(using=queryset.db)
    try:
        sql, params = compiler.as_sql()
    except EmptyResultSet:
        raise ValueError("CompiledLookup: the query compiled to no SQL (a value out of its field's range?); "
                         "use the ORM for this query") from None
    return compiler, sql, list(params)


class _Compiled:
    __slots__ = ("db", "sql", "params", "slots", "compiler", "converters", "init_list", "model_slice",
                 "populators", "annotations", "model")

    def __init__(self, build: Callable[..., QuerySet], types: tuple[type, ...], optional: frozenset[int]):
        markers = [tuple(marker_for(t, i, variant) for i, t in enumerate(types)) for variant in (0, 1)]
        queryset = build(*markers[0])
        self.db = queryset.db
        self.compiler, self.sql, self.params = _compile(queryset)
        _, other_sql, other_params = _compile(build(*markers[1]))
        if other_sql != self.sql or len(other_params) != len(self.params):
            raise ValueError("CompiledLookup: the SQL text depends on the values (inlined?); use the ORM")
        # (position, value index, wrapper): the backend may bind a value wrapped in a typed subclass
        # (psycopg's Int8 for a BigIntegerField Value()); the bound value gets the same wrapper.
        self.slots: list[tuple[int, int, type]] = []
        for position, (first, second) in enumerate(zip(self.params, other_params, strict=True)):
            if first == second and type(first) is type(second):
                continue  # a constant of the query
            index = next((i for i, m in enumerate(markers[0]) if isinstance(first, type(m)) and first == m), None)
            if index is None or not (isinstance(second, types[index]) and second == markers[1][index]):
                raise ValueError(f"CompiledLookup: parameter {position} is a value transformed before binding "
                                 f"({first!r}); use the ORM for this query")
            self.slots.append((position, index, type(first)))
        for index in range(len(types)):
            if index not in optional and not any(slot[1] == index for slot in self.slots):
                raise ValueError(f"CompiledLookup: value #{index} is not a bound parameter of the compiled SQL; "
                                 "use the ORM for this query")
        klass_info = self.compiler.klass_info
        select = self.compiler.select
        # What results_iter() would work out per call: the from-database converters of the columns.
        self.converters = self.compiler.get_converters([s[0] for s in select[: self.compiler.col_count]])
        self.model = klass_info["model"]
        fields = klass_info["select_fields"]
        self.model_slice = slice(fields[0], fields[-1] + 1)
        self.init_list = [f[0].target.attname for f in select[self.model_slice]]
        self.populators = get_related_populators(klass_info, select, self.db)
        self.annotations = list(self.compiler.annotation_col_map.items())


_NONE = object()  # the shape's queryset is .none(): no query at all (e.g. the scope of an anonymous user)


class CompiledLookup:
    """`lookup.get(build, *values, shape=key)`: the one instance `build(*values)` selects, or None.

    `types` gives each value's type (`int` or `str`). A value listed in `optional` may go unused
    by some shapes (the user id of a staff scope, which is not filtered at all); every other value
    must be bound. `build` is called only when its shape is first seen in a thread, with markers
    for values; `shape` must hold everything else `build` branches on. More than one matching row
    raises MultipleObjectsReturned, as `.get()` does.
    """

    def __init__(self, *types: type, optional: tuple[int, ...] = ()):
        self.types = types
        self.optional = frozenset(optional)
        self._local = threading.local()

    def _compiled(self, shape: Hashable, build: Callable[..., QuerySet]) -> Any:
        cache = self._local.__dict__.setdefault("cache", {})
        compiled = cache.get(shape)
        if compiled is None:
            probe = build(*(marker_for(t, i) for i, t in enumerate(self.types)))
            compiled = _NONE if probe.query.is_empty() else _Compiled(build, self.types, self.optional)
            cache[shape] = compiled
        return compiled

    def get(self, build: Callable[..., QuerySet], *values: Any, shape: Hashable) -> Model | None:
        for value, expected in zip(values, self.types, strict=True):
            if type(value) is not expected:
                raise TypeError(f"CompiledLookup: expected {expected.__name__}, got {type(value).__name__}")
        compiled = self._compiled(shape, build)
        if compiled is _NONE:
            return None
        params = list(compiled.params)
        for position, index, wrapper in compiled.slots:
            params[position] = values[index] if wrapper is self.types[index] else wrapper(values[index])
        with connections[compiled.db].cursor() as cursor:
            cursor.execute(compiled.sql, params)
            rows = cursor.fetchmany(2)
        if not rows:
            return None
        if len(rows) > 1:
            raise MultipleObjectsReturned(f"CompiledLookup on {compiled.model.__name__} matched more than one row")
        row = rows[0]
        if compiled.converters:
            row = next(iter(compiled.compiler.apply_converters([row], compiled.converters)))
        obj = compiled.model.from_db(compiled.db, compiled.init_list, row[compiled.model_slice])
        for populator in compiled.populators:
            populator.populate(row, obj)
        for attr, position in compiled.annotations:
            setattr(obj, attr, row[position])
        return obj
