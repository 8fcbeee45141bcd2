"""What a per-tensor statistic declares: its columns, the inputs it reads, its chunk kernel, its tier.

One ``Statistic`` is everything the toolkit needs to know about a quantity of the ``tensor_stats`` table
(torchmetrics declares a metric's states with their cross-rank reduction the same way): the store builds
the table, its rollups and the cross-shard combination from the ``Column``s, the probe and ``dynascope
diff`` run the kernel over flat chunks of each tensor, the rows are derived from the partial results by
one function (``stats.rows``), and the dashboard pools the declared ``Figure``s.

Nothing here imports torch: the store and the dashboard read these declarations without it. Kernels
import torch when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["BOOL", "DEFAULT_CHUNK_ELEMS", "F64", "I32", "I64", "INPUTS", "STR", "TENSOR_COLUMNS", "TIERS", "Chunk", "Column", "Figure",
           "Settings", "Statistic", "count", "frac"]

F64, I64, I32, STR, BOOL = pa.float64(), pa.int64(), pa.int32(), pa.string(), pa.bool_()
# Without a budget: 4M elements a chunk, i.e. temporaries of at most ~100 MB whatever the tensor's size.
DEFAULT_CHUNK_ELEMS = 1 << 22


@dataclass(frozen=True)
class Column:
    """One ``tensor_stats`` column: type, unit, how it combines across chunks and ranks, how it pools.

    ``reduce``: how the values of one tensor's chunks, and of its shards (FSDP/DTensor, one row per
    rank), combine into the whole tensor's value, torchmetrics' ``dist_reduce_fx``: "sum", "norm" (root
    of the summed squares), "max", "all" (booleans), "first" (metadata every shard shares); None for keys
    and derived columns. A derived column is computed from combined values, never combined itself:
    ``frac_of`` (that count over ``numel``), ``ratio`` (numerator, denominator), ``flag_of`` (true where
    that column has a value). ``zero_where_finite``: the count is known to be 0 where that norm is finite
    (a finite norm proves there is no NaN/Inf element); ``null_where_not_finite``: the value is NULL where
    that norm is not finite (a threshold derived from it would count every element, or none). ``pool``: the rollup columns this one feeds, as
    (rollup column, how, where): "sq" Σx², "sum" Σx, "max", "numel" Σnumel over rows where ``where``
    (default: this column) is not NULL, so every count pools beside the element count it is out of.
    ``stored=False``: a partial result other columns derive from (‖θ₀‖ for ``drift_ratio``), not stored.
    ``summary``: listeners (the wandb mirror) get its mean per tensor kind.
    """

    name: str
    type: pa.DataType
    unit: str = ""  # "elements", "steps"; "" for norms, ratios and fractions (dimensionless or the weights' unit)
    reduce: str | None = None
    frac_of: str | None = None
    ratio: tuple[str, str] | None = None
    pool: tuple[tuple[str, str, str | None], ...] = ()
    doc: str = ""
    flag_of: str | None = None
    zero_where_finite: str | None = None
    null_where_not_finite: str | None = None
    stored: bool = True
    summary: bool = False

    @property
    def integer(self) -> bool:
        return pa.types.is_integer(self.type)

    @property
    def derived(self) -> bool:
        return self.frac_of is not None or self.ratio is not None or self.flag_of is not None


def count(name: str, doc: str, numel: str | None = None, **kw: Any) -> Column:
    """An element count that sums across chunks and shards, pools as a sum, and with ``numel`` beside the
    Σnumel of the rows where it has a value; ``kw``: further ``Column`` fields."""
    pool = ((name, "sum", None),) + (((numel, "numel", None),) if numel else ())
    return Column(name, I64, "elements", "sum", pool=pool, doc=doc, **kw)


def frac(count_name: str, summary: bool = False) -> Column:
    """``count / numel`` of one tensor (pooled figures are Σcount / Σnumel, never means of fractions)."""
    return Column(count_name.removesuffix("_count") + "_frac", F64, frac_of=count_name, doc=f"{count_name} / numel",
                  summary=summary)


@dataclass(frozen=True)
class Figure:
    """A figure pooled over any set of rollup rows: Σnum / Σden, or √Σnum / √Σden with ``root`` (ratios of
    norms). ``heat``: the dashboard offers it as a layer × step heat map, under ``label``."""

    name: str
    label: str
    num: str
    den: str
    root: bool = False
    heat: bool = False


# The per-tensor description every row carries, filled by the source of the tensors (the probe's tracked
# list, a checkpoint): numel is the local shard's element count under FSDP/DTensor/ZeRO.
TENSOR_COLUMNS: tuple[Column, ...] = (
    Column("tensor", STR, doc="parameter name, wrapper prefixes removed (core.naming.normalize_name)"),
    Column("layer", I32, reduce="first"), Column("kind", STR, reduce="first"),
    Column("shape", STR, reduce="first"), Column("dtype", STR, reduce="first"),
    Column("numel", I64, "elements", "sum", pool=(("numel", "sum", None),)),
    Column("sharded", BOOL),
    # Where the row sits in its device mesh (DTensor: FSDP2, HSDP, tensor parallel; NULL without one):
    # ``mesh`` the mesh's shape ("2x2"), ``shard`` this rank's coordinates along the dimensions that shard
    # the tensor ("1"; "" when none does), ``replica`` its index along the dimensions that replicate it
    # (HSDP's replicate dimension). Replicas hold the same shard: only replica 0's rows count (``store.pooling``).
    Column("mesh", STR, reduce="first"), Column("shard", STR), Column("replica", I32),
)

# What a kernel may read, per flat chunk of one tensor: the weights after the step (``new``), before it
# (``old``: the pre-step snapshot, or the previous checkpoint), θ₀ (``ref``), the weights k steps back
# as bf16 (``k_snapshot``, PULSE's S_k) and the gradient (``grad``, read before the step).
INPUTS = ("new", "old", "ref", "k_snapshot", "grad")
# Which tensors a statistic covers at a record, among those whose inputs the record holds:
#   "every"   every tensor at every record (one batched pass when ``Statistic.batched`` is given: ‖g‖);
#   "cadence" every tensor at every ``w_norm_every``-th record, the window's tensors at the others;
#   "window"  the rotating window's tensors (the memory and time budgets size it), chunk by chunk.
TIERS = ("every", "cadence", "window")


@dataclass(frozen=True)
class Settings:
    """Parameters of the built-in kernels: η of the relative change, the near-zero gradient tolerance."""

    eta: float = 1e-3
    grad_tol: float = 1e-8


class Chunk:
    """One flat chunk of one tensor's inputs, as a kernel reads them (an input not read is None).

    ``numel`` is the whole tensor's element count, ``given`` the tensor's values of the columns the
    statistic declared in ``given`` (0-d device tensors), ``settings`` the run's ``Settings``. ``copies``:
    (input, destination) pairs the pass also writes, the input's chunk copied (or cast, to a bf16
    destination) there while it is read, e.g. the next snapshot.
    """

    __slots__ = ("copies", "given", "grad", "k_snapshot", "new", "numel", "old", "ref", "settings")
    new: Tensor
    old: Tensor
    ref: Tensor
    k_snapshot: Tensor
    grad: Tensor

    def __init__(self, numel: int, settings: Settings, given: dict[str, Any] | None = None) -> None:
        self.numel, self.settings, self.given = numel, settings, given or {}
        self.copies: list[tuple[str, Tensor]] = []  # (input, destination): the chunk copied (cast) there
        for name in INPUTS:
            setattr(self, name, None)

    def set(self, name: str, value: Any) -> None:
        setattr(self, name, value)


Kernel = Callable[[Chunk], Sequence["Tensor"]]


@dataclass(frozen=True)
class Statistic:
    """One per-tensor statistic (or a family computed in one kernel, sharing its temporaries).

    ``kernel(chunk)`` returns one 0-d partial result per name in ``outputs``, for one flat chunk; the
    engine combines the chunks' partials as each output column's ``reduce`` says, so a kernel never sees a
    whole tensor and its temporaries stay chunk-sized. ``outputs`` name columns declared here or by
    another statistic (the update kernel also gives ``w_norm``, in the same pass as ‖ΔW‖). ``batched``:
    the same outputs for a list of whole tensors at once, float64 [n, len(outputs)] (one fused norm over
    every tensor), used by the "every" and "cadence" tiers. ``given``: columns of the same tensor computed
    by an earlier pass that the kernel reads (``Chunk.given``). ``transient``: the kernel's temporaries at
    their peak, per chunk element, as (buffers at least fp32 wide, bytes): with an element size e, a chunk
    of n elements holds at most n·(wide·max(4, e) + bytes); the memory budget sizes chunks by the largest.
    ``figures``: pooled figures the dashboard draws from this statistic's rollup columns.

    ``element``: the statistic as one term per element and output (``stats.elementwise``), instead of a
    ``kernel``: the kernel is then that function on the chunk's tensors, and ``stats.fused`` compiles it,
    with the other element-wise statistics of a pass, into one loop over the elements. ``scalars(chunk)``:
    the per-tensor values it reads besides the inputs (η, a threshold). ``bitwise``: outputs that compare
    bits in the inputs' own dtype, undefined (NULL) when the inputs' dtypes differ.
    """

    name: str
    columns: tuple[Column, ...] = ()
    outputs: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    kernel: Kernel | None = None
    batched: Callable[[list[Any]], Any] | None = None
    tier: str = "window"
    given: tuple[str, ...] = ()
    transient: tuple[int, int] = (0, 0)
    figures: tuple[Figure, ...] = ()
    doc: str = ""
    element: Callable[..., tuple[Any, ...]] | None = None
    scalars: Callable[[Chunk], dict[str, Any]] | None = None
    bitwise: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.element is not None and self.kernel is None:  # the element function on chunk tensors
            from dynascope.stats.elementwise import element_kernel

            object.__setattr__(self, "kernel", element_kernel(self))
        if self.tier not in TIERS:
            raise ValueError(f"statistic {self.name}: tier must be one of {TIERS}, not {self.tier!r}")
        unknown = [i for i in self.inputs if i not in INPUTS]
        if unknown:
            raise ValueError(f"statistic {self.name}: unknown inputs {unknown} (known: {INPUTS})")
        if self.outputs and (self.kernel is None and self.batched is None):
            raise ValueError(f"statistic {self.name}: outputs without a kernel")
        if self.outputs and not self.inputs:
            raise ValueError(f"statistic {self.name}: a kernel needs inputs")
        if "grad" in self.inputs and len(self.inputs) > 1:
            raise ValueError(f"statistic {self.name}: the gradient is read before the step, alone")
        if self.batched is not None and len(self.inputs) != 1:
            raise ValueError(f"statistic {self.name}: a batched kernel reads one input")

    def transient_bytes(self, chunk_elems: int, element_size: int = 4) -> int:
        wide, extra = self.transient
        return chunk_elems * (wide * max(4, element_size) + extra)
