"""The frozen base a job trains over, read in place from the weights the server already maps: the served model's
entry in the prepared-weights cache (docs/weights-cache.md; motet/engine/worker/prepared_weights.py), whose packed
projections (the native CPU step's panels: [ceil(N / 16), K, 16] for an [N, K] weight, the lm_head's also the tied
embedding table) and other tensors are views of one file the server maps. The worker maps the same file, so its
base is the server's pages (the machine's proportional set size counts them once), not a private copy (0.5 GB in
float32 for the default model).

`shared_base` builds transformers' model of the checkpoint on the meta device and gives each parameter its place
in the entry: a projection (q_proj ... down_proj, lm_head) becomes a `PanelLinear` over its panels (q/k/v and
gate/up are row ranges of the decoder's fused qkv_proj and gate_up_proj, motet/models/projections.py), the
embedding a `PanelEmbedding` reading rows of the lm_head's panels where the table is tied, the norms and biases the
entry's tensors. PEFT wraps a `PanelLinear` as any `nn.Linear`, and TRL's trainer runs as it does on
`from_pretrained`'s model. Before it is used, every 1-D tensor and sampled rows of every matrix are compared with
the checkpoint (read from the file, a few pages): an entry whose values are not the checkpoint's (a family that
folds constants into its weights, another layout) is not used. None where it cannot be used (no entry for the
model in the run's dtype: the cache off, a first start that prepared the weights in memory, a quantized or
tensor-parallel server; another architecture's layout): the trainer then loads its own copy.

A `PanelLinear`'s product is the same sum as `nn.Linear`'s (float tolerance: the GEMM's blocking differs), each
output column a dot product of the input with one row of the weight; the panels are read a few MiB at a time,
never copied whole.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from motet.kernels import cpu_native

log = logging.getLogger("motet.training")

PANEL = cpu_native.PANEL  # rows of a weight per panel
CHUNK_BYTES = (
    1 << 20
)  # the panels made into one GEMM operand at a time (measured: 1 MiB fastest of 64 KiB-4 MiB)
SAMPLED_ROWS = 8  # rows of each matrix compared with the checkpoint before the entry is used


class PanelRows(torch.Tensor):
    """The [N, K] matrix that panels [P, K, 16] hold, as the code that reads a layer's `weight` directly sees it
    (TRL's chunked log-probabilities read the lm_head's `weight[start:end]`): its `shape` is [N, K] and a run of
    rows is read out of the panels (a copy of those rows); any other use reads the panels themselves."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # (ops on it give plain tensors)

    @staticmethod
    def of(panels: torch.Tensor, rows: int) -> PanelRows:
        out = panels.as_subclass(PanelRows)
        out.rows = rows
        return out

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, super().shape[1]))

    def __getitem__(self, index):
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(self.rows)
            panels, stop = self.as_subclass(torch.Tensor), max(start, stop)
            if start % PANEL == 0 and _native(panels):  # (TRL's vocabulary chunks: rows 0, 32768, ...)
                return cpu_native.unpack_rows(panels, start, stop).to(panels.dtype)
            return dense_rows(panels, torch.arange(start, stop))
        raise TypeError(f"the rows of panels are read by a slice of rows, not {index!r}")


def _native(panels: torch.Tensor) -> bool:
    """Whether the CPU kernels read these panels (fp32 or bf16, contiguous)."""
    return (
        panels.dtype in cpu_native.DTYPE_CODES and panels.is_contiguous() and cpu_native.library() is not None
    )


def dense_rows(panels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the matrix `panels` hold: [len(rows), K] (row r: column r % 16 of panel r // 16)."""
    return panels[rows // PANEL, :, rows % PANEL]


class PanelLinear(nn.Linear):
    """An `nn.Linear` (frozen) whose [out, in] weight is the native step's panels, `panels` [P, in, 16] (rows past
    `out_features` zero); its `weight` is their `PanelRows` (a plain attribute: nothing here trains it)."""

    def __init__(self, panels: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.panels = panels
        self.weight = PanelRows.of(panels, out_features)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _PanelProduct.apply(x, self.panels, self.out_features)
        return y if self.bias is None else y + self.bias


class PanelEmbedding(nn.Module):
    """An embedding table looked up in the lm_head's panels (the tied table the served model reads the same way:
    motet/kernels/cpu_native.py's `packed_rows`)."""

    def __init__(self, head: PanelLinear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = None
        self.panels, self.weight = head.panels, head.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dense_rows(self.panels, ids)


def _chunks(panels: torch.Tensor):
    P, K, R = panels.shape
    step = max(1, CHUNK_BYTES // (K * R * panels.element_size()))
    for a in range(0, P, step):
        yield a * R, panels[a : a + step]


def panel_product(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] @ W.T for the [n, K] weight W that `panels` holds: [..., n]. The serving step's own GEMM reads
    the panels as they are (fp32 inputs; as fast as torch's on a dense weight); otherwise a few MiB of them at a
    time are made into one dense operand."""
    K = panels.shape[1]
    x2 = x.reshape(-1, K)
    if x2.dtype == torch.float32 and _native(panels):
        return cpu_native.gemm(x2.contiguous(), panels, n).reshape(*x.shape[:-1], n)
    parts = [x2 @ w.permute(1, 0, 2).reshape(K, -1) for _, w in _chunks(panels)]
    return torch.cat(parts, dim=1)[:, :n].reshape(*x.shape[:-1], n)


def panel_product_t(g: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """g [..., n] @ W for the [n, K] weight W that `panels` holds: [..., K] (the input's gradient)."""
    P, K, R = panels.shape
    g2 = g.reshape(-1, g.shape[-1])
    n = g2.shape[1]
    out = g2.new_zeros(g2.shape[0], K)
    native = g2.dtype == torch.float32 and _native(panels)
    for row, w in _chunks(panels):
        rows = min(w.shape[0] * R, n - row)
        if rows <= 0:
            break
        # the chunk's rows of W, dense: transposed out of the panels in registers by the CPU kernels (torch's
        # strided copy took a tenth of a training step)
        dense = (
            cpu_native.unpack_rows(panels, row, row + rows)
            if native
            else w.transpose(1, 2).reshape(-1, K)[:rows]
        )
        out.addmm_(g2[:, row : row + rows], dense)
    return out.reshape(*g.shape[:-1], K)


class _PanelProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, panels, n):
        ctx.save_for_backward(panels)
        return panel_product(x, panels, n)

    @staticmethod
    def backward(ctx, g):
        (panels,) = ctx.saved_tensors
        return (panel_product_t(g, panels) if ctx.needs_input_grad[0] else None), None, None


def shared_base(model_dir: Path, dtype: str) -> nn.Module | None:
    """transformers' model of `model_dir` over the served model's prepared weights in `dtype`, or None (logged)
    where there are none it can read."""
    try:
        model = _build(Path(model_dir), getattr(torch, dtype))
    except _NotShared as e:
        log.warning("the base is loaded as a copy of its own: %s", e)
        return None
    log.info("the base is read from the server's prepared weights")
    return model


class _NotShared(Exception):
    pass


def _entry(model_dir: Path, dtype: torch.dtype):
    from motet.engine.weights.prepared_store import PreparedStore
    from motet.engine.worker.prepared_weights import entry_of

    _, _, key = entry_of(model_dir, None, dtype)
    entry = PreparedStore().open(key)
    if entry is None:
        raise _NotShared(f"no prepared weights of {model_dir} in {dtype} (the server did not map any)")
    layout = entry.layout
    if layout["quantized"]["linears"] or layout["quantized"]["experts"]:
        raise _NotShared("the prepared weights are quantized")
    if layout["table"]["kind"] not in ("head", "tensor"):
        raise _NotShared(f"the embedding table is read from {layout['table']['kind']}")
    return entry


def _build(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from motet.engine.worker.prepared_weights import ARENA
    from motet.models.projections import DECODER_FUSED, FUSED_SHARD

    entry = _entry(model_dir, dtype)
    layout = entry.layout
    arena = entry.tensor(ARENA)
    panels = {}
    for name, (offset, dt, shape) in zip(layout["packed"], layout["puts"], strict=True):
        n = getattr(torch, dt).itemsize
        for d in shape:
            n *= d
        panels[name] = arena[offset : offset + n].view(getattr(torch, dt)).view(shape)
    tensors = {name: entry.tensor(name) for name in entry.names() if name != ARENA}
    config = AutoConfig.from_pretrained(str(model_dir))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._name_or_path = str(model_dir)
    modules = dict(model.named_modules())
    places: dict[str, torch.Tensor] = {}  # HF parameter -> its values (for the check)

    def place(hf_module: str) -> tuple[str, int]:
        """The entry's name of a module and the first row of its shard there."""
        parts = hf_module.split(".")
        parts = parts[1:] if parts[0] == model.base_model_prefix else parts
        fused, shard = FUSED_SHARD.get(parts[-1], (parts[-1], None))
        if shard is None:
            return ".".join(parts), 0
        prefix = ".".join([*parts[:-1], fused])
        first = sum(modules[".".join([*hf_module.split(".")[:-1], p])].out_features
                    for p in DECODER_FUSED[fused][:shard])  # fmt: skip
        return prefix, first

    head = None
    for name, module in list(modules.items()):
        if type(module) is nn.Linear:
            where, first = place(name)
            packed = panels.get(f"{where}.weight")
            if packed is None or first % PANEL or packed.shape[1] != module.in_features:
                raise _NotShared(f"{name} has no packed weight of its shape in the entry")
            p = packed[first // PANEL : -(-(first + module.out_features) // PANEL)]
            bias = None
            if module.bias is not None:
                if f"{where}.bias" not in tensors:
                    raise _NotShared(f"{name}'s bias is not in the entry")
                bias = tensors[f"{where}.bias"][first : first + module.out_features]
            new = PanelLinear(p, module.in_features, module.out_features, bias)
            model.set_submodule(name, new)
            places[f"{name}.weight"] = new.panels
            if bias is not None:
                places[f"{name}.bias"] = new.bias
            if where == "lm_head":
                head = new
    embed = model.get_input_embeddings()
    embed_name = next(n for n, m in model.named_modules() if m is embed)
    if layout["table"]["kind"] == "head":
        if head is None:
            raise _NotShared("the table is read from an lm_head the model does not have")
        if head.out_features != embed.num_embeddings:
            raise _NotShared("the table is not the lm_head's shape")
        table = PanelEmbedding(head)
        model.set_input_embeddings(table)
        places[f"{embed_name}.weight"] = table.panels
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in places:
            continue
        where, _ = place(name.rpartition(".")[0])
        key = f"{where}.{name.rpartition('.')[2]}"
        if key not in tensors or tuple(tensors[key].shape) != tuple(param.shape):
            raise _NotShared(f"{name} is not in the entry")
        module, _, attr = name.rpartition(".")
        model.get_submodule(module)._parameters[attr] = nn.Parameter(tensors[key], requires_grad=False)
        places[name] = tensors[key]
    if missing := [n for n, p in model.named_parameters() if p.is_meta]:
        raise _NotShared(f"{missing[0]} is not in the entry")
    _check(model, model_dir, dtype)
    return model.eval()


def _check(model: nn.Module, model_dir: Path, dtype: torch.dtype) -> None:
    """Every 1-D tensor and SAMPLED_ROWS rows of every matrix equal to the checkpoint's (read from its file)."""
    from motet.engine.weights.checkpoint import iter_weights

    stored = dict(iter_weights(model_dir))
    generator = torch.Generator().manual_seed(0)
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, module in model.named_modules():
        if not isinstance(module, (PanelLinear, PanelEmbedding)):
            continue
        source = stored.get(f"{name}.weight")
        if source is None and tied and module is model.get_output_embeddings():
            continue  # (the embedding table's, checked as the table)
        if source is None:
            raise _NotShared(f"{name}.weight is not in the checkpoint")
        n = module.weight.shape[0]
        rows = torch.cat([torch.tensor([0, n - 1]), torch.randint(n, (SAMPLED_ROWS,), generator=generator)])
        want = torch.stack([source.read_rows(int(r), int(r) + 1)[0] for r in rows.unique()]).to(dtype)
        if tuple(source.shape) != tuple(module.weight.shape) or not torch.equal(
            want, dense_rows(module.panels, rows.unique())
        ):
            raise _NotShared(
                f"the prepared {name} is not the checkpoint's (the family transforms its weights)"
            )
    for name, param in model.named_parameters():
        source = stored.get(name)
        if source is None:
            raise _NotShared(f"{name} is not in the checkpoint")
        if tuple(source.shape) != tuple(param.shape) or not torch.equal(
            source.load().to(dtype), param.detach()
        ):
            raise _NotShared(
                f"the prepared {name} is not the checkpoint's (the family transforms its weights)"
            )
