"""Filling a decoder (`CausalLM`, motet/engine/worker/model.py) from a checkpoint's Hugging Face-named tensors:
each name placed in the decoder's parameters (the family's module names renamed, q/k/v and gate/up into their
fused shards, an expert's projections into the stacked experts), this rank's part sliced out under tensor or
expert parallelism, modules a checkpoint fuses split (Phi-3's qkv_proj), stacked experts restacked (GPT-OSS's,
MXFP4 ones dequantized), the family's constants folded in; then each tensor copied a run of rows at a time, or
held quantized (a checkpoint's own blocks, or quantized as it loads, the lm_head in int8). Every parameter must
be filled; a tensor with no place, a wrong shape or a format the layer cannot hold fails the load naming it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from motet.engine.weights.checkpoint import CHUNK_BYTES, StoredTensor, row_chunks
from motet.engine.weights.gguf_table import GgufTable
from motet.engine.weights.mxfp4 import Mxfp4Tensor
from motet.engine.worker.layers import Linear
from motet.engine.worker.model import STACKED, CausalLM, Experts, QuantizedExperts
from motet.engine.worker.parallel import ROW_PARALLEL
from motet.kernels.quant import BLOCK, INT8, QuantizedWeight, WeightFormat
from motet.models.declaration import ModelLoadError
from motet.models.projections import FUSED_SHARD

QUANTIZE_BYTES = 1 << 20  # the fp32 values `load_weights` quantizes at once


def _read(tensor: torch.Tensor | StoredTensor | Mxfp4Tensor) -> torch.Tensor:
    """A checkpoint tensor's values (read from its file, dequantized: an MXFP4 one in fp32)."""
    return tensor.load() if isinstance(tensor, (StoredTensor, Mxfp4Tensor)) else tensor


def load_weights(
    model: CausalLM,
    weights: Iterable[tuple[str, torch.Tensor | StoredTensor | QuantizedWeight]],
    quantize: WeightFormat | None = None,
) -> None:
    """`model` (made by `CausalLM.allocate`) filled from `weights`: `DecoderWeights.load`."""
    DecoderWeights(model).load(weights, quantize)


class DecoderWeights:
    """Where a checkpoint's tensors go in `model` (this rank's shard of the decoder), and their loading."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.config = model.config
        self.parallel = model.parallel
        self.names = {name for name, _ in model.named_parameters(remove_duplicate=False)}

    def quantized_formats(self, fmt: WeightFormat) -> dict[str, WeightFormat]:
        """Which weights `load_weights(..., quantize=fmt)` quantizes, by parameter name: the decoder's
        projections into `fmt` and the lm_head into int8; ModelLoadError where this model cannot be (before
        anything is read). The embedding table keeps the checkpoint's precision (a lookup reads one row a
        token); the lm_head is a product over the whole vocabulary, a fifth of a small model's bytes per token,
        so it is quantized too but at 8 bits, where the logits' rounding stays small: llama.cpp's 4-bit files
        keep it in Q8_0 (or Q6_K) the same way. An attention layer's `unquantized` projections keep the checkpoint's
        precision (a latent attention's kv_b_proj)."""
        cfg = self.config
        dims = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size}
        if cfg.is_moe:
            dims["moe_intermediate_size"] = cfg.moe_intermediate_size
        dims.update(self.model.layers[0].self_attn.block_inputs())
        for name, value in dims.items():
            if value % BLOCK:
                raise ModelLoadError(
                    f"{fmt.name} quantization needs the inputs of every projection in whole blocks of {BLOCK}; "
                    f"this model's {name} is {value}: serve it unquantized"
                )
        linears = set(self.model.decoder_linears()) - {
            lin for layer in self.model.layers for lin in layer.self_attn.unquantized()
        }
        for name, lin in self.model.named_modules():  # a tensor-parallel rank's part: its own inputs
            if isinstance(lin, Linear) and lin in linears and lin.in_features % BLOCK:
                raise ModelLoadError(
                    f"{fmt.name} quantization needs the inputs of every projection in whole blocks of {BLOCK}; "
                    f"this rank's part of {name} has {lin.in_features}: serve the model with another "
                    f"--tensor-parallel-size, or unquantized"
                )
        for name, experts in self._experts().items():
            if experts.intermediate % BLOCK:
                raise ModelLoadError(
                    f"{fmt.name} quantization needs the inputs of every projection in whole blocks of {BLOCK}; "
                    f"this rank's part of {name}.down_proj has {experts.intermediate}: serve the model with "
                    f"another --tensor-parallel-size, or unquantized"
                )
        formats = {f"{name}.weight": fmt for name, lin in self.model.named_modules() if lin in linears}
        formats.update({f"{name}.{key}": fmt for name in self._experts() for key in STACKED})
        if cfg.hidden_size % BLOCK == 0:
            formats["lm_head.weight"] = INT8
        return formats

    def _experts(self) -> dict[str, Experts]:
        """The sparse layers' experts by module name."""
        return {name: m for name, m in self.model.named_modules() if isinstance(m, Experts)}

    def _split_sizes(self, name: str) -> list[int]:
        """Row sizes of a fused parameter's shards ([n] for an unfused one) on this rank; `name` is the
        parameter's."""
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else name
        if module == "qkv_proj":
            attn = self.model.get_submodule(".".join(parts[:-2]))
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if module == "gate_up_proj":  # a dense MLP's or the shared expert's: its own intermediate size
            layer = self.model.get_submodule(".".join(parts[:-2]))
            return [layer.intermediate, layer.intermediate]
        if parts[-1] in ("gate_up_proj", "down_proj"):  # stacked experts
            experts = self.model.get_submodule(".".join(parts[:-1]))
            if parts[-1] == "gate_up_proj":  # shard 2e is expert e's gate, 2e + 1 its up
                return [experts.intermediate] * (2 * experts.num_local)
            return [self.config.hidden_size] * experts.num_local  # shard e is expert e's
        return [-1]

    def _rank_part(self, name: str, shard: int | None, tensor: torch.Tensor | QuantizedWeight):
        """The part of a checkpoint tensor (one shard of parameter `name`) that this rank holds: q/k/v,
        gate/up and the experts' gate/up split by output rows (their biases, attention sinks and norms across
        all heads with them), o and down by input columns (their biases, the experts' down biases: rank 0's,
        zeros elsewhere, added once by the all-reduce), the embedding table and lm_head by vocabulary rows;
        other norms and routers whole. A quantized weight splits the same way (its input columns in whole
        blocks, or the load fails naming the layer)."""
        try:
            return self._rank_slice(name, shard, tensor)
        except ValueError as e:
            raise ModelLoadError(
                f"{name} cannot be split over {self.parallel.size} ranks in its quantized blocks ({e}): serve it "
                f"with another --tensor-parallel-size or unquantized"
            ) from None

    def _rank_slice(self, name: str, shard: int | None, tensor):
        par = self.parallel
        if not par.enabled:
            return tensor
        parts = name.split(".")
        leaf, module = parts[-1], parts[-2] if len(parts) > 1 else ""
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start, _, rows = par.vocab_rows(self.config.vocab_size)
            return tensor.narrow(0, start, rows)
        owner = self.model.get_submodule(".".join(parts[:-1] if module == "experts" else parts[:-2]))
        if leaf == "sinks":  # one a query head: this rank's
            attn = self.model.get_submodule(".".join(parts[:-1]))
            return tensor.narrow(0, attn.q_rows[0] // attn.head_dim, attn.num_heads)
        if (
            (module in ROW_PARALLEL and leaf == "bias")
            or (module == "experts" and leaf == "down_proj_bias" and not par.expert_parallel)
        ):  # after a split input: added once, by rank 0 (the others' zeros), when the all-reduce sums the parts
            return tensor if par.rank == 0 else torch.zeros(tensor.shape)
        if module == "experts" and par.expert_parallel:
            if leaf.endswith("_bias"):  # [E, ...]: this rank's experts, a block of consecutive ones
                return tensor.narrow(0, par.rank * owner.num_local, owner.num_local)
            return tensor  # whole experts (the ones not held here never reach this)
        if module == "experts" and leaf == "gate_up_proj_bias":  # [E, 2I]: gate columns, then up columns
            (start, n), inter = owner.columns, tensor.shape[1] // 2
            return torch.cat([tensor.narrow(1, start, n), tensor.narrow(1, inter + start, n)], dim=1)
        if module in ("q_norm", "k_norm") and self.config.qk_norm_whole:  # across all heads: this rank's
            return tensor.narrow(0, *(owner.q_rows if module == "q_norm" else owner.kv_rows))
        if module == "qkv_proj":
            start, n = (owner.q_rows, owner.kv_rows, owner.kv_rows)[shard]
            return tensor.narrow(0, start, n)
        if module == "o_proj":
            return tensor.narrow(1, *owner.o_columns)
        # an attention's own unfused projections: its heads' rows
        unfused = getattr(owner, "unfused_rows", {})
        if module in unfused:
            return tensor.narrow(0, *unfused[module])
        if module == "gate_up_proj" or (module == "experts" and leaf == "gate_up_proj"):
            return tensor.narrow(0, *owner.columns)
        if module == "down_proj" or (module == "experts" and leaf == "down_proj"):
            return tensor.narrow(1, *owner.columns)
        return tensor

    def _shard(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        """The part of `param` that a checkpoint tensor fills (None: all of it)."""
        sizes = self._split_sizes(name)
        if shard is None:
            return param
        if (
            param.dim() == 3
        ):  # stacked experts (one expert's down_proj too): shard -> (expert, part of its rows)
            per_expert = len(sizes) // param.shape[0]
            expert, part = divmod(shard, per_expert)
            return param[expert].narrow(0, part * sizes[shard], sizes[shard])
        if len(sizes) == 1:
            return param
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _all_shards(self, name: str) -> range:
        return range(len(self._split_sizes(name)))

    def _describe(self, name: str, shard: int) -> str:
        """A shard's name in an error message: a stacked expert weight's says which expert's projection."""
        if name.split(".")[-1] not in ("gate_up_proj", "down_proj"):
            return f"{name}[{shard}]"
        if name.endswith("gate_up_proj"):
            expert, part = divmod(shard, 2)
            return f"{name}[{shard}] (expert {expert}'s {('gate_proj / w1', 'up_proj / w3')[part]})"
        return f"{name}[{shard}] (expert {shard}'s down_proj / w2)"

    # An expert's projection (its checkpoint name as the declaration renames it) -> (the stacked parameter, its
    # part in the expert's rows)
    EXPERT_PROJECTIONS = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", 0),
    }

    ELSEWHERE = ("", None)  # a tensor another rank holds (expert parallelism)

    def _place(self, hf_name: str) -> tuple[str, int | None] | None:
        """(parameter name, shard) a Hugging Face tensor name fills (shard None: the whole parameter), None
        where it has no place in this model, ELSEWHERE where it is not read here (another rank's experts, a layer
        past the decoder's that its declaration skips)."""
        parts = hf_name.removeprefix("model.").split(".")
        if (
            len(parts) > 2
            and parts[0] == "layers"
            and parts[1].isdigit()
            and int(parts[1]) >= self.config.num_hidden_layers
            and self.config.declaration.skips_trailing_layers
        ):
            return self.ELSEWHERE  # (not this decoder's: DeepSeek-V3's multi-token-prediction layers)
        if len(parts) > 2 and parts[0] == "layers":  # the family's own module names -> the decoder's
            renames = self.config.declaration.checkpoint_names
            parts = [renames.get(p, p) for p in parts]
        # layers.{i}.mlp.experts.{e}.{projection}.weight: one expert's slice of the stacked weights
        if len(parts) == 7 and parts[3] == "experts" and parts[4].isdigit() and parts[6] == "weight":
            stacked, part = self.EXPERT_PROJECTIONS.get(parts[5], (None, 0))
            expert = int(parts[4])
            if stacked is None or expert >= self.config.num_experts:
                return None
            if self.parallel.expert_parallel:  # this rank's experts are a block of consecutive ones
                per = self.config.num_experts // self.parallel.size
                expert -= self.parallel.rank * per
                if not 0 <= expert < per:
                    return self.ELSEWHERE
            name = ".".join([*parts[:4], stacked])
            return name, expert * (2 if stacked == "gate_up_proj" else 1) + part
        if len(parts) == 1:
            return hf_name, None
        if ".".join(parts) in self.names:  # the decoder's own module (a latent attention's q_proj: unfused)
            return ".".join(parts), None
        module, shard = FUSED_SHARD.get(parts[-2], (parts[-2], None))
        parts[-2] = module
        return ".".join(parts), shard

    def _unfused(self, weights):
        """The checkpoint's tensors, those of a module its declaration says holds several projections (Phi-3's
        qkv_proj) split by rows into theirs (q_proj, k_proj, v_proj), read lazily like any other."""
        fused = self.config.declaration.fused_modules
        cfg = self.config
        rows = cfg.projection_rows
        for hf_name, tensor in weights:
            parts = hf_name.split(".")
            if len(parts) < 2 or parts[-2] not in fused:
                yield hf_name, tensor
                continue
            sizes = [rows[p] for p in fused[parts[-2]]]
            if isinstance(tensor, QuantizedWeight) or tensor.shape[0] != sum(sizes):
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}; {cfg.architecture} holds "
                    f"{' + '.join(fused[parts[-2]])} in it: {sum(sizes)} rows"
                )
            start = 0
            for part, n in zip(fused[parts[-2]], sizes, strict=True):
                yield ".".join([*parts[:-2], part, parts[-1]]), tensor.narrow(0, start, n)
                start += n

    def _restacked(self, weights):
        """Stacked experts in the layout a declaration says its checkpoints have (`Architecture.expert_layout`)
        turned into the decoder's an expert at a time: GPT-OSS's gate_up [E, H, 2I], gate and up columns
        interleaved, as each expert's gate_proj and up_proj [I, H]; its down [E, I, H] as each expert's down_proj
        [H, I]; its gate_up bias [E, 2I] as gate columns then up columns. An expert is read (from an MXFP4
        checkpoint: read and dequantized, motet/engine/weights/mxfp4.py) only when it is converted, and not at all where
        another rank holds it: loading holds one expert's floats besides the weights."""
        cfg = self.config
        E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        expected = {
            "gate_up_proj": (E, H, 2 * inter),
            "gate_up_proj_bias": (E, 2 * inter),
            "down_proj": (E, inter, H),
        }
        interleaved = cfg.declaration.expert_layout == "interleaved"
        for hf_name, tensor in weights:
            prefix, _, kind = hf_name.rpartition("experts.") if ".experts." in hf_name else ("", "", "")
            if isinstance(tensor, Mxfp4Tensor) and not (
                interleaved and kind in ("gate_up_proj", "down_proj")
            ):
                raise ModelLoadError(
                    f"checkpoint tensor {tensor.name!r} is MXFP4: motet reads MXFP4 only for stacked experts "
                    f"stored interleaved (GPT-OSS's gate_up_proj and down_proj), not in {cfg.architecture}"
                )
            if not interleaved or kind not in expected:
                yield hf_name, tensor
                continue
            if isinstance(tensor, QuantizedWeight):
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} is quantized: {kind} must come in floats"
                )
            if tuple(tensor.shape) != expected[kind]:
                label = f"{tensor.name!r} (MXFP4)" if isinstance(tensor, Mxfp4Tensor) else repr(hf_name)
                raise ModelLoadError(
                    f"checkpoint tensor {label} has shape {tuple(tensor.shape)}, the model expects {expected[kind]}"
                )
            if kind == "gate_up_proj_bias":  # gate columns 0, 2, 4, ..., up columns 1, 3, 5, ...
                t = _read(tensor)
                yield hf_name, torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
                continue
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            for e in range(E):
                names = [f"{prefix}experts.{e}.{part}.weight" for part in parts]
                if self._place(names[0]) is self.ELSEWHERE:
                    continue
                if isinstance(
                    tensor, Mxfp4Tensor
                ):  # kept in its blocks: [2I, H] (gate, up rows alternating) or [H, I]
                    q = tensor.expert(e)
                    if kind == "down_proj":
                        yield names[0], q
                    else:
                        rows = torch.arange(q.shape[0])
                        yield names[0], q.rows(rows[0::2])
                        yield names[1], q.rows(rows[1::2])
                    continue
                t = _read(tensor.narrow(0, e, 1))[0]  # [H, 2I] or [I, H]
                if kind == "down_proj":
                    yield names[0], t.T
                else:
                    yield names[0], t[:, 0::2].T
                    yield names[1], t[:, 1::2].T

    def _folded(self, weights):
        """The family's constants folded into the weights they follow, so that every backend computes them
        without an op of its own: its scales (ModelConfig.weight_scales: Granite's attention and residual
        multipliers into q_proj, o_proj and down_proj, its logits scaling into the final norm; Gemma's attention
        scale into q_norm) and its norm weights' offset (Gemma's 1 + w)."""
        scales, renames = self.config.weight_scales, self.config.declaration.checkpoint_names
        for hf_name, tensor in weights:
            parts = hf_name.removeprefix("model.").split(".")
            module = renames.get(parts[-2], parts[-2]) if len(parts) > 1 else ""
            offset = self.config.norm_weight_offset if module.endswith("norm") else 0.0
            if (module not in scales or (module == "norm" and len(parts) != 2)) and not offset:
                yield hf_name, tensor
                continue
            if isinstance(tensor, QuantizedWeight):
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} is quantized: {self.config.architecture}'s multipliers are "
                    "folded into it, which its blocks do not allow"
                )
            loaded = tensor.load() if isinstance(tensor, StoredTensor) else tensor
            yield hf_name, (loaded.float() + offset) * scales.get(module, 1.0)

    @torch.no_grad()
    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor | StoredTensor | QuantizedWeight]],
        quantize: WeightFormat | None = None,
    ) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up; every parameter must be filled. Each tensor
        is converted to its parameter's dtype as it is copied, a run of rows at a time (`_fill`). A projection
        may come quantized (a GGUF file's blocks): its layer then holds it in that format (a fused layer's
        shards all in one format). With `quantize`, the weights `quantized_formats` names are quantized as they
        load, from the checkpoint's own values: every row quantizes on its own (a block is a run of one row's
        inputs), so a fused layer's shards quantized one by one are the fused weight quantized."""
        model = self.model
        formats = self.quantized_formats(quantize) if quantize is not None else {}
        scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)  # each run of rows read from a file, in turn
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, int]] = set()
        quantized: dict[str, dict[int, QuantizedWeight]] = {}  # weight name -> its shards, until all are in
        linears = set(model.decoder_linears())
        projections = {f"{n}.weight": m for n, m in model.named_modules() if m in linears}
        stacked = {f"{n}.{key}": m for n, m in self._experts().items() for key in STACKED}
        tied = model.lm_head.weight is model.embed_tokens.weight
        device = model.norm.weight.device
        if self.parallel.enabled:  # the last rank's vocabulary shard ends in padding rows: zeros
            model.embed_tokens.weight.zero_()
            model.lm_head.weight.zero_()  # (one `allocate` deferred is made with zeros: `_allocate`)
        for hf_name, tensor in self._folded(self._restacked(self._unfused(weights))):
            if "rotary_emb" in hf_name:
                continue
            place = self._place(hf_name)
            if place is self.ELSEWHERE:
                continue
            param = params.get(place[0]) if place is not None else None
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}"
                )
            name, shard = place
            target = self._shard(param, name, shard)
            tensor = self._rank_part(name, shard, tensor)
            vocab_part = name in ("embed_tokens.weight", "lm_head.weight") and self.parallel.enabled
            if vocab_part:
                target = target[: tensor.shape[0]]  # the last rank's shard: padding rows past the vocabulary
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            if isinstance(tensor, GgufTable):  # a GGUF file's table: looked up in its own blocks
                if name != "embed_tokens.weight":
                    raise ModelLoadError(
                        f"checkpoint tensor {hf_name!r}: only the embedding table is looked up"
                    )
                model.embed_tokens = tensor.to_dtype(model.weight_dtype)
                loaded.add((name, 0))
                continue
            if name in formats and not isinstance(tensor, QuantizedWeight):
                tensor = self._fill(None, tensor, scratch, formats[name])
            if isinstance(tensor, QuantizedWeight) and name in ("embed_tokens.weight", "lm_head.weight"):
                # a quantized output (or tied table): the lm_head multiplies in its blocks, the embedding
                # table holds their values (a lookup)
                if name == "embed_tokens.weight":
                    model.embed_tokens.weight[: tensor.shape[0]].copy_(tensor.dequantize())
                if name == "lm_head.weight" or tied:
                    self._quantized_lm_head(tensor)
                    loaded.add(("lm_head.weight", 0))
            elif isinstance(tensor, QuantizedWeight):
                if name not in projections and name not in stacked:
                    raise ModelLoadError(
                        f"checkpoint tensor {hf_name!r} is quantized: only projections and the lm_head may be"
                    )
                if shard is None and len(self._split_sizes(name)) > 1:
                    if name not in stacked:
                        raise ModelLoadError(
                            f"checkpoint tensor {hf_name!r} is quantized: a fused projection's parts must come "
                            f"one by one"
                        )
                    # all of the stacked experts at once (quantized as they loaded): its rows are the shards'
                    sizes = self._split_sizes(name)
                    tensor = tensor.to(device)
                    starts = [sum(sizes[:i]) for i in range(len(sizes))]
                    quantized[name] = {
                        i: tensor.narrow(0, a, n) for i, (a, n) in enumerate(zip(starts, sizes, strict=True))
                    }
                    loaded.update((name, i) for i in self._all_shards(name))
                    continue
                quantized.setdefault(name, {})[shard or 0] = tensor.to(device)
            elif name == "embed_tokens.weight" and tied and "lm_head.weight" in formats:
                # the table keeps the checkpoint's values; the lm_head multiplies in blocks of them
                self._quantized_lm_head(self._fill(target, tensor, scratch, formats["lm_head.weight"]))
                loaded.add(("lm_head.weight", 0))
            else:
                if param.is_meta:  # deferred by `CausalLM.allocate`: floats come, so it is made now
                    param = params[name] = self._allocate(name)
                    target = self._shard(param, name, shard)
                    target = target[: tensor.shape[0]] if vocab_part else target
                self._fill(target, tensor, scratch)
            loaded.update((name, i) for i in ((shard,) if shard is not None else self._all_shards(name)))
        for name, shards in quantized.items():
            n = len(self._split_sizes(name))
            if len({q.format for q in shards.values()}) > 1 or any(
                (name, i) in loaded and i not in shards for i in range(n)
            ):
                raise ModelLoadError(f"checkpoint tensors of {name}: its parts must all be in one format")
            if len(shards) == n:  # else the missing parts are reported below
                weight = QuantizedWeight.cat([shards[i] for i in range(n)])
                if name in stacked:  # every expert's rows, one expert after another
                    experts, key = stacked[name], name.rpartition(".")[2]
                    experts.quantized[key] = QuantizedExperts(weight, experts.num_local)
                    setattr(experts, key, self._released())
                    continue
                layer = projections[name]
                layer.quantized = weight
                layer.weight = self._released()
        # Every parameter, every shard of a fused one, must come from the checkpoint.
        expected = {(name, i) for name, _ in model.named_parameters() for i in self._all_shards(name)}
        missing = sorted(self._describe(name, i) for name, i in expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(missing[:5])}")

    def _fill(
        self,
        target: torch.Tensor | None,
        tensor: torch.Tensor | StoredTensor,
        scratch: torch.Tensor,
        fmt: WeightFormat | None = None,
    ) -> QuantizedWeight | None:
        """`tensor` copied into `target` (converted to its dtype; None: not copied) and, with `fmt`, quantized
        into that format on the model's device from its own values, a run of rows at a time read into
        `scratch`: loading never holds a whole checkpoint tensor besides the weights."""
        device = self.model.norm.weight.device
        parts = []
        for start, rows in row_chunks(tensor, buffer=scratch):
            if target is not None:
                target[start : start + rows.shape[0]].copy_(rows)
            if fmt is not None:  # a MiB of fp32 values at a time: quantizing makes a few fp32 copies of them
                step = max(1, QUANTIZE_BYTES // max(1, rows[:1].numel() * 4))
                rows = rows.reshape(-1, rows.shape[-1])  # (stacked experts: their rows one after another)
                parts += [fmt.quantize(part.to(device)) for part in rows.split(step)]
        return QuantizedWeight.cat(parts) if fmt is not None else None

    def _quantized_lm_head(self, weight: QuantizedWeight) -> None:
        """The lm_head multiplies in `weight`'s blocks (a rank's vocabulary shard: padded to the rows every rank
        holds); its float weight is released (a tied one: the table stays)."""
        head = self.model.lm_head
        head.quantized = weight.padded(head.out_features).to(self.model.norm.weight.device)
        head.weight = self._released()

    def _allocate(self, name: str) -> nn.Parameter:
        """The weight `name`, deferred by `CausalLM.allocate`, made in the model's dtype on its device (an
        lm_head's with zeros: a tensor-parallel rank's padding rows)."""
        module_name, _, key = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        like = self.model.norm.weight
        make = torch.zeros if name == "lm_head.weight" else torch.empty
        param = nn.Parameter(make(getattr(module, key).shape, dtype=like.dtype, device=like.device), False)
        setattr(module, key, param)
        return param

    def _released(self) -> nn.Parameter:
        """An empty weight for a layer that holds its weight quantized."""
        like = self.model.norm.weight
        return nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), False)
