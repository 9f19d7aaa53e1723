"""CompiledLookup: SQL the ORM compiled once, bound per call — same answers as the ORM, or a refusal."""

import threading

import pytest
from django.contrib.auth.models import AnonymousUser
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils.functional import SimpleLazyObject

from portal.core.fields import ScopedSlugRelatedField
from portal.core.statements import VARIANTS, CompiledLookup, marker_for, marker_user
from reservations.api.serializers import _bookable_pools, _bookable_tenants
from tenants.auth import _TOKEN, _token_by_hash
from tenants.models import ApiToken, Tenant

from .conftest import make_world

pytestmark = pytest.mark.django_db


def _fields(obj):
    return {k: v for k, v in vars(obj).items() if k != "_state"}


class _Request:
    def __init__(self, user):
        self.user = user


def _scoped(scope, user, slug, slug_field="slug", per_user=True):
    field = ScopedSlugRelatedField(slug_field=slug_field, scope=scope, per_user=per_user)
    field._context = {"request": _Request(user)}
    return field.to_internal_value(slug)


def test_token_lookup_matches_the_orm_including_the_selected_user(world):
    for token in ApiToken.objects.all():
        orm = ApiToken.objects.select_related("user").get(key_hash=token.key_hash, revoked=False)
        with CaptureQueriesContext(connection) as ctx:
            compiled = _TOKEN.get(_token_by_hash, token.key_hash, shape="token")
            assert _fields(compiled.user) == _fields(orm.user)  # already loaded: no second query
        assert len(ctx.captured_queries) == 1
        assert {k: v for k, v in _fields(compiled).items() if k != "_state"}.keys() == _fields(orm).keys()
        assert compiled.pk == orm.pk and compiled.expires_at == orm.expires_at
    assert _TOKEN.get(_token_by_hash, "0" * 64, shape="token") is None


def test_a_revoked_token_is_not_found(world):
    token = ApiToken.objects.filter(user=world.users["alpha-lead"]).get()
    assert _TOKEN.get(_token_by_hash, token.key_hash, shape="token") is not None
    ApiToken.objects.filter(pk=token.pk).update(revoked=True)
    assert _TOKEN.get(_token_by_hash, token.key_hash, shape="token") is None
    assert world.client("alpha-lead").get("/api/v1/reservations/").status_code == 401


def test_the_tenant_scope_answers_as_the_orm_does_for_every_kind_of_user(world):
    cases = [(world.users[who], slug) for who in ("alpha-lead", "alpha-viewer", "beta-member", "staff")
             for slug in ("alpha", "beta", "nope")]
    for user, slug in cases:
        try:
            expected = _bookable_tenants(user).get(slug=slug)
        except Tenant.DoesNotExist:
            expected = None
        try:
            got = _scoped(_bookable_tenants, user, slug)
        except Exception as exc:  # the field's "unknown" validation error
            assert expected is None, (user, slug, exc)
            continue
        assert expected is not None, (user, slug)
        assert _fields(got) == _fields(expected), (user, slug)
        # The annotations are the bound user's, never the marker that stood in for them at compile time.
        assert got.role_of_user_id == user.pk and got.role_of_user == expected.role_of_user


def test_a_lazy_request_user_is_copied_never_changed(world):
    # Under session auth request.user is a SimpleLazyObject whose setup returns the request's cached
    # user: the marker must go into a copy of that user, not into it.
    real = world.users["alpha-lead"]
    original_pk = real.pk
    lazy = SimpleLazyObject(lambda: real)
    lookup = CompiledLookup(int)
    got = lookup.get(lambda pk: Tenant.objects.for_user(marker_user(lazy, pk)), real.pk, shape="lazy")
    assert got.slug == "alpha" and real.pk == original_pk == lazy.pk


def test_the_anonymous_scope_runs_no_query(world):
    with CaptureQueriesContext(connection) as ctx, pytest.raises(Exception, match="Unknown"):
        _scoped(_bookable_tenants, AnonymousUser(), "alpha")
    assert ctx.captured_queries == []


def test_pool_lookup_carries_the_bookable_count(world):
    world.nodes[0].state = "retired"
    world.nodes[0].save(update_fields=["state"])
    pool = _scoped(_bookable_pools, world.users["beta-viewer"], "h100", slug_field="name", per_user=False)
    assert pool.pk == world.pool.pk and pool.bookable_nodes == len(world.nodes) - 1


def test_values_that_would_not_be_bound_are_refused_at_compile_time(world):
    lookup = CompiledLookup(str)
    with pytest.raises(ValueError, match="transformed"):  # icontains binds '%value%'
        lookup.get(lambda slug: Tenant.objects.filter(slug__icontains=slug), "alp", shape="icontains")
    with pytest.raises(ValueError, match="inlined"):  # the SQL text would change with the value
        lookup.get(lambda slug: Tenant.objects.extra(where=[f"slug = '{slug.strip(chr(0))}'"]), "alpha",
                   shape="extra")
    with pytest.raises(ValueError, match="not a bound parameter"):
        lookup.get(lambda slug: Tenant.objects.filter(slug="alpha"), "alpha", shape="ignored")
    with pytest.raises(TypeError):
        lookup.get(lambda slug: Tenant.objects.filter(slug=slug), 7, shape="typed")


def test_values_derived_or_transformed_in_python_are_refused(world):
    # Three marker sets of different lengths, case, spacing and uneven integer strides: a value the
    # query derives from another (len, + 1) or transforms (lower, strip) never passes for a marker.
    from django.db.models.functions import Length

    Tenant.objects.filter(slug="alpha").update(storage_quota_tib=20, vlan_id=100)
    for shape, types, build in [
        ("len", (str,), lambda s: Tenant.objects.annotate(n=Length("name")).filter(slug=s, n__gte=len(s))),
        ("lower", (str,), lambda s: Tenant.objects.filter(slug=s.lower())),
        ("strip", (str,), lambda s: Tenant.objects.filter(slug=s.strip())),
        ("plus one", (int, int), lambda a, b: Tenant.objects.filter(storage_quota_tib__gte=a,
                                                                    storage_quota_tib__lt=a + 1, vlan_id=b)),
        ("double", (int, int), lambda a, b: Tenant.objects.filter(storage_quota_tib=a, vlan_id=2 * a + b)),
    ]:
        with pytest.raises(ValueError, match="transformed or derived|no SQL"):
            CompiledLookup(*types).get(build, *([7] * len(types) if types[0] is int else ["alpha"]), shape=shape)


def test_querysets_it_cannot_build_like_the_orm_are_refused(world):
    lookup = CompiledLookup(str)
    for shape, build in [("prefetch", lambda s: Tenant.objects.prefetch_related("memberships").filter(slug=s)),
                         ("values", lambda s: Tenant.objects.filter(slug=s).values("pk"))]:
        with pytest.raises(ValueError, match="plain model querysets"):
            lookup.get(build, "alpha", shape=shape)


def test_a_member_scope_must_bind_the_user(world):
    # A scope that forgot the user (or read it from somewhere else) would resolve any tenant for anyone.
    with pytest.raises(ValueError, match="not a bound parameter"):
        _scoped(lambda user: Tenant.objects.all(), world.users["beta-lead"], "alpha")
    # The stand-in user carries nothing but its id and staff flag: a scope reading anything else of
    # the real user fails loudly instead of freezing the first user's data into the statement.
    real = world.users["beta-lead"]
    real.tenant_ids = [world.tenants["beta"].pk]
    with pytest.raises(AttributeError):
        _scoped(lambda user: Tenant.objects.filter(pk__in=user.tenant_ids), real, "beta")


def test_more_than_one_row_is_an_error_as_with_get(world):
    lookup = CompiledLookup(int)
    build = lambda quota: Tenant.objects.filter(storage_quota_tib=quota)  # noqa: E731
    with pytest.raises(Tenant.MultipleObjectsReturned):
        lookup.get(build, 10, shape="quota")  # both tenants have the default 10 TiB
    Tenant.objects.filter(slug="beta").update(storage_quota_tib=20)
    assert lookup.get(build, 20, shape="quota").slug == "beta"


def test_a_value_the_orm_drops_as_out_of_range_is_refused(world):
    # storage_quota_tib is a PositiveIntegerField: Django compiles a negative or too-large value to an
    # empty filter. A small-integer field would do so for the int markers themselves: refused, not
    # cached as "never matches".
    lookup = CompiledLookup(int)
    with pytest.raises(ValueError, match="no SQL"):
        lookup.get(lambda n: Tenant.objects.filter(storage_quota_tib__lt=-n), 1, shape="negated")


def test_markers_are_values_no_caller_passes():
    assert all("\x00" in marker_for(str, i, v) for i in range(3) for v in range(VARIANTS))  # text cannot hold NUL
    assert len({marker_for(str, 0, v).lower().strip() for v in range(VARIANTS)}) == VARIANTS
    ints = {marker_for(int, i, v) for i in range(3) for v in range(VARIANTS)}
    assert len(ints) == 3 * VARIANTS and all(0 < m < 2**31 for m in ints)


@pytest.mark.django_db(transaction=True)
def test_threads_compile_their_own_and_answer_right_under_concurrency():
    world = make_world()
    users = [world.users[w] for w in ("alpha-lead", "beta-lead", "alpha-viewer", "beta-viewer")]
    errors, barrier = [], threading.Barrier(8)

    def run(i):
        user = users[i % len(users)]
        own = "alpha" if "alpha" in user.username else "beta"
        try:
            barrier.wait()
            for _ in range(25):
                assert _scoped(_bookable_tenants, user, own).role_of_user_id == user.pk
                with pytest.raises(Exception, match="Unknown"):
                    _scoped(_bookable_tenants, user, "beta" if own == "alpha" else "alpha")
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
