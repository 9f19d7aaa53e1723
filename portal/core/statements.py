"""Hot-path lookups whose SQL the ORM writes once per thread instead of once per request.

Building and compiling a queryset costs several hundred microseconds of Python each time
(cloning, resolving lookups, `as_sql`), more than PostgreSQL takes to run the prepared statement
it yields. Every API request authenticates its token, and every booking resolves its tenant
through the tenant scope and its pool: the same three query shapes, request after request,
with different values.

A `CompiledLookup` keeps the ORM as the only author of that SQL. `build(*values)` returns the
queryset exactly as the code would otherwise write it (scopes, annotations, select_related); it
is compiled once per thread and shape, three times over, with three different sets of *markers*
standing in for the values — strings holding NUL (PostgreSQL text cannot, so no real value is a
marker) of different lengths, letter case and surrounding spaces; integers in range, spaced
unevenly. The SQL text must come out identical and, at every parameter that differs between the
three, each compile must have bound one and the same marker unchanged: those positions are where
later calls bind their values. Anything else — a value the ORM inlined into the SQL text, bound
transformed (`icontains` binds `%value%`, a field may lower-case or strip), derived from (`len`,
`+ 1`), or judged out of the field's range (Django then compiles the filter to nothing) — makes
the lookup refuse to compile rather than run a wrong statement. Each call then builds the model
instance the way Django's `ModelIterable` does (the same converters, select_related populators
and annotations); querysets that need more (prefetch_related, values(), a related manager's
known objects) are refused.

`build` must be a pure function of its arguments and of the shape: whatever it reads from the
database, the clock or settings is frozen into the thread's compiled statement.

The *shape* of a queryset may depend on more than the bound values (a scope returns everything
to staff, nothing to the anonymous): callers pass a `shape` key holding whatever else `build`
branches on. The cache is per thread because a compiler belongs to its thread's connection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from django.core.exceptions import EmptyResultSet
from django.db import connections
from django.db.models import Model, QuerySet
from django.db.models.query import ModelIterable, get_related_populators
from django.utils.functional import LazyObject, empty

__all__ = ["CompiledLookup", "marker_for", "marker_user"]

# Three marker sets (see above). Integers: a base per set and an uneven stride per set, so no value
# derived from one marker (a + 1, 2 * a) equals another marker in every set.
_INT_MARKERS = ((2_011_000_000, 104_729), (2_029_000_000, 7_919), (2_047_000_000, 1_000_003))
_STR_MARKERS = ("\x00m{}\x00", "\x00 PORTAL-Marker-{}-Variant-Two \x00", "\x00\tportal marker {} (3)\x00\x00  ")
VARIANTS = 3


def marker_for(kind: type, index: int, variant: int = 0) -> Any:
    if kind is int:
        base, stride = _INT_MARKERS[variant]
        return base + index * stride
    if kind is str:
        return _STR_MARKERS[variant].format(index)
    raise TypeError(f"CompiledLookup values are int or str, not {kind.__name__}")


def marker_user(user: Any, pk: int) -> Any:
    """A fresh user standing in for user in a scope: the marker pk and the caller's `is_staff`, and
    nothing else of the real user (no attribute, cache or prefetched relation a scope could read
    and freeze into the compiled SQL for every later user of the thread). The anonymous stay so."""
    if isinstance(user, LazyObject):  # request.user under session auth
        if user._wrapped is empty:
            user._setup()
        user = user._wrapped
    if user is None or not getattr(user, "is_authenticated", False):
        from django.contrib.auth.models import AnonymousUser

        return AnonymousUser()
    return type(user)(pk=pk, is_staff=bool(user.is_staff))


def _compile(queryset: QuerySet):
    if queryset._prefetch_related_lookups or queryset._known_related_objects or (
            queryset._iterable_class is not ModelIterable):
        raise ValueError("CompiledLookup: only plain model querysets (no prefetch_related, values(), related "
                         "manager); use the ORM for this query")
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

    def __init__(self, build: Callable[..., QuerySet], queryset: QuerySet, types: tuple[type, ...],
                 optional: frozenset[int]):
        """queryset: build's for the first marker set (already built by the caller)."""
        markers = [tuple(marker_for(t, i, v) for i, t in enumerate(types)) for v in range(VARIANTS)]
        self.db = queryset.db
        self.compiler, self.sql, self.params = _compile(queryset)
        others = [_compile(build(*m))[1:] for m in markers[1:]]
        if any(sql != self.sql or len(params) != len(self.params) for sql, params in others):
            raise ValueError("CompiledLookup: the SQL text depends on the values (inlined?); use the ORM")
        # (position, value index, wrapper): the backend may bind a value wrapped in a typed subclass
        # (psycopg's Int8 for a BigIntegerField Value()); the bound value gets the same wrapper.
        self.slots: list[tuple[int, int, type]] = []
        for position, first in enumerate(self.params):
            column = [first, *(params[position] for _, params in others)]
            if all(type(p) is type(first) and p == first for p in column):
                continue  # a constant of the query
            index = next((i for i, m in enumerate(markers[0]) if isinstance(first, type(m)) and first == m), None)
            if index is None or not all(isinstance(p, types[index]) and type(p) is type(first)
                                        and p == markers[v][index] for v, p in enumerate(column)):
                raise ValueError(f"CompiledLookup: parameter {position} is a value transformed or derived before "
                                 f"binding ({first!r}); use the ORM for this query")
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

    `types` gives each value's type (`int` or `str`). Every value must be bound, except those a
    call lists in `optional` — for shapes that do not use them (the user id of a staff scope,
    which filters nothing); `optional` is part of the shape and must be the same for every call
    with that key. `build` is called only when its shape is first seen in a thread, with markers
    for values; `shape` must hold everything else `build` branches on. More than one matching
    row raises the model's MultipleObjectsReturned, as `.get()` does.
    """

    def __init__(self, *types: type):
        self.types = types
        self._local = threading.local()

    def _compiled(self, shape: Hashable, build: Callable[..., QuerySet], optional: tuple[int, ...]) -> Any:
        cache = self._local.__dict__.setdefault("cache", {})
        compiled = cache.get(shape)
        if compiled is None:
            first = build(*(marker_for(t, i) for i, t in enumerate(self.types)))
            compiled = _NONE if first.query.is_empty() else _Compiled(build, first, self.types, frozenset(optional))
            cache[shape] = compiled
        return compiled

    def get(self, build: Callable[..., QuerySet], *values: Any, shape: Hashable,
            optional: tuple[int, ...] = ()) -> Model | None:
        for value, expected in zip(values, self.types, strict=True):
            if type(value) is not expected:
                raise TypeError(f"CompiledLookup: expected {expected.__name__}, got {type(value).__name__}")
        compiled = self._compiled(shape, build, optional)
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
            raise compiled.model.MultipleObjectsReturned(
                f"CompiledLookup on {compiled.model.__name__} matched more than one row")
        row = rows[0]
        if compiled.converters:
            row = next(iter(compiled.compiler.apply_converters([row], compiled.converters)))
        obj = compiled.model.from_db(compiled.db, compiled.init_list, row[compiled.model_slice])
        for populator in compiled.populators:
            populator.populate(row, obj)
        for attr, position in compiled.annotations:
            setattr(obj, attr, row[position])
        return obj
