"""DeepSeek's multi-head latent attention (MLA) over the paged latent cache, in torch (the reference, and the eager
path) but for the absorbed decode's attention (motet/kernels/latent_decode.py: a Triton kernel on CUDA, its torch
reference elsewhere); the native CPU step's latent op computes every row in the absorbed form
(motet/kernels/csrc/latent.h).

Each layer's cache holds, per token, one row: the normed latent c_kv (kv_lora_rank) and the rotated key shared by
every head (qk_rope_head_dim), in the same blocks, block tables and prefix cache as per-head K / V
(ModelConfig.cache_layout). A step computes its rows in one of two forms, as vLLM's and SGLang's MLA backends do:

- prefill rows (a sequence with several new tokens): the expanded form. The sequence's c_kv, cached ones
  included, goes through kv_b_proj into every head's unrotated key and its value; each head attends over
  [k_nope, k_rope] with its [q_nope, q_rope], causally.
- decode rows (one new token): the absorbed form. kv_b_proj's key half is folded into the query
  (q_nope W_UK: one latent query a head), so that every head attends over the cached rows themselves
  (multi-query attention with a head of kv_lora_rank + qk_rope_head_dim, values the rows' c_kv part: the paged
  attention every backend has), and the value half is applied after it (o W_UV). The product is the same;
  the cache is read once for all heads and nothing per head is made of it.

A step of decode rows only (`max_query_len` 1, no adapter on kv_b_proj: every CUDA graph's step) is not split: its
rows and paged context are the step's own, so that nothing in its layers waits for the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from motet.engine.worker.attention_metadata import AttentionMetadata
from motet.engine.worker.layers import Linear, RMSNorm
from motet.engine.worker.op_writer import OpWriter, panel_bytes
from motet.engine.worker.parallel import SINGLE, Parallel
from motet.kernels import cpu_native
from motet.kernels.attention_args import PagedContext
from motet.kernels.latent_decode import latent_decode
from motet.kernels.paged_attention import write_kv_cache
from motet.kernels.rope_kv import RotaryAngles, rotate_reference
from motet.lora.pool import GROUP_OF, LoRABatch
from motet.models.config import ModelConfig
from motet.models.projections import QKV

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (transformers' default: not the config's)
_MAX_SCORE_ELEMS = 1 << 22  # score elements per product in the expanded form (16 MiB of fp32)
MAX_LATENT_ROPE = 256  # the native latent op's rotated key at most (the source's kMaxLatentRope)


@dataclass
class LatentSplit:
    """A step's rows by the form that computes them: made by the first latent layer, kept on the step's
    metadata for the others (AttentionMetadata.derive)."""

    # [n] the rows of one-token sequences (every row: slice(None)), None: there are none
    decode_rows: torch.Tensor | slice | None
    decode_ctx: PagedContext | None  # their paged context (the step's, those sequences only; or the step's)
    # each sequence with several new tokens: (first row, end row, context length incl. the new tokens, blocks)
    prefills: list[tuple[int, int, int, list[int]]]


def split_step(meta: PagedContext, block_size: int, absorb: bool = True) -> LatentSplit:
    """The step's rows by form; without `absorb` every row in the expanded form (an adapter on kv_b_proj: its
    delta is applied to each sequence's expanded context). A step of one-token rows only is all decode rows over
    its own context, read without waiting for the device."""
    if absorb and meta.max_query_len == 1:
        return LatentSplit(slice(None), meta, [])
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1 and absorb]
    several = [b for b in range(len(lens)) if starts[b + 1] - starts[b] > (1 if absorb else 0)]
    tables = meta.block_tables[several].tolist() if several else []
    prefills = [
        (starts[b], starts[b + 1], lens[b], table[: -(-lens[b] // block_size)])
        for b, table in zip(several, tables, strict=True)
    ]
    if not decodes:
        return LatentSplit(None, None, prefills)
    dev = meta.block_tables.device
    index = torch.tensor(decodes, device=dev)
    ctx = PagedContext(
        block_tables=meta.block_tables.index_select(0, index),
        query_start_loc=torch.arange(len(decodes) + 1, dtype=torch.int32, device=dev),
        seq_lens=meta.seq_lens.index_select(0, index),
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
    )
    return LatentSplit(torch.tensor([starts[b] for b in decodes], device=dev), ctx, prefills)


class LatentAttention(nn.Module):
    """MLA over this rank's heads (all of them on one rank); the projections by their Hugging Face names, so that
    checkpoints load as they are. Under tensor parallelism each rank holds its heads' rows of q_proj / q_b_proj
    and kv_b_proj and their columns of o_proj, and the whole of q_a_proj, kv_a_proj_with_mqa and the latent norms:
    every rank computes and caches the whole latent (it is one row a token), and its heads attend over it; the
    output is a partial sum over the ranks (the decoder layer all-reduces it)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, parallel: Parallel = SINGLE):
        super().__init__()
        mla = cfg.attention
        self.layer_idx = layer_idx
        (head_start, self.num_heads), _ = parallel.heads(cfg)
        H = self.num_heads
        self.rank, self.nope, self.rope, self.v_dim = (
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        )
        self.interleaved = mla.rope_interleave
        qk = self.nope + self.rope
        # this rank's rows of the checkpoint's q_proj / q_b_proj and kv_b_proj, and its columns of o_proj
        self.q_rows = (head_start * qk, H * qk)
        self.kv_b_rows = (head_start * (self.nope + self.v_dim), H * (self.nope + self.v_dim))
        self.o_columns = (head_start * self.v_dim, H * self.v_dim)
        self.unfused_rows = {"q_proj": self.q_rows, "q_b_proj": self.q_rows, "kv_b_proj": self.kv_b_rows}
        bias = cfg.attention_bias
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, H * qk, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, cfg.hidden_size, bias=bias)
        self.scale = latent_softmax_scale(cfg)

    def projections(self) -> list[Linear]:
        return [
            lin
            for lin in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj)
            if lin is not None
        ] + [self.o_proj]

    def unquantized(self) -> list[Linear]:
        """The projections that keep the checkpoint's precision under `--quantization`: kv_b_proj, whose weight the
        absorbed form reads itself as each head's W_UK and W_UV (batched products, no Linear), as vLLM's MLA
        dequantizes it at load. It is small: 32 MiB a layer of DeepSeek-V3 in bf16, beside about 160 MiB of its other
        attention projections and 10.5 GiB of its experts at 8 bits."""
        return [self.kv_b_proj]

    @staticmethod
    def graph_options(num_drafts: int) -> dict:
        """`DecodeGraphs`' options: only rows of one token replayed, not the verification rows of drafts (the
        expanded form, which rows of several tokens take, sizes each sequence's context on the host), nor adapters
        on kv_b_proj (the same): those steps run eagerly."""
        return dict(max_query=1, eager_targets=("kv_b_proj",))

    def block_inputs(self) -> dict[str, int]:
        """None beyond its projections' own (checked one by one)."""
        return {}

    def native_unsupported(self) -> str | None:
        """Why the native step's latent op does not take this layer, or None: its rotated key within the op's,
        an unrotated key part in every head (the op folds kv_b_proj's key half into the query)."""
        if self.rope > MAX_LATENT_ROPE:
            return f"qk_rope_head_dim {self.rope} (the latent op turns at most {MAX_LATENT_ROPE})"
        if self.nope < 1:
            return "qk_nope_head_dim 0 (the latent op folds each head's unrotated key part into its query)"
        return None

    def _rotate(self, x: torch.Tensor, angles: RotaryAngles) -> torch.Tensor:
        """The rotary on [T, heads, rope]: DeepSeek's neighbouring pairs (x0, x1), (x2, x3), ... turned as
        transformers turns them, their results laid out as halves (evens, then odds): the same permutation of q's
        and k's rotated parts, so their products are unchanged."""
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        cos, sin = angles.rows()
        return rotate_reference(x, cos, sin)

    def forward(
        self, x, angles: RotaryAngles, meta: AttentionMetadata, kv_cache, lora: LoRABatch | None = None
    ):
        T, H = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self._project(self.q_proj, x, lora, "q_proj")
        else:
            q_a = self.q_a_layernorm(self._project(self.q_a_proj, x, lora, "q_a_proj"))
            q = self._project(self.q_b_proj, q_a, lora, "q_b_proj")
        q = q.view(T, H, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], self._rotate(q[..., self.nope :], angles)
        kv = self._project(self.kv_a_proj_with_mqa, x, lora, "kv_a_proj_with_mqa")
        c_kv = self.kv_a_layernorm(kv[:, : self.rank].contiguous())
        k_rope = self._rotate(kv[:, self.rank :].unsqueeze(1), angles)
        (cache,) = kv_cache
        latent = torch.cat([c_kv.unsqueeze(1), k_rope], dim=-1).to(cache.dtype)  # [T, 1, rank + rope]
        write_kv_cache(latent, latent, cache, cache, meta.slot_mapping)
        # (an adapter on kv_b_proj: no absorbed form, its delta is per sequence)
        absorb = lora is None or not lora.targets(("kv_b_proj",))
        split: LatentSplit = meta.derive("latent", lambda: split_step(meta, cache.shape[1], absorb))
        out = q.new_zeros(T, H, self.v_dim)  # (rows past the step's: zeros)
        if split.decode_rows is not None:
            rows = split.decode_rows
            out[rows] = self._absorbed(q_nope[rows], q_rope[rows], cache, split.decode_ctx)
        for start, end, seq_len, blocks in split.prefills:
            on_kv_b = lora is not None and lora.targets(("kv_b_proj",))
            context = lora.of_row(start, seq_len) if on_kv_b else None
            out[start:end] = self._expanded(
                q_nope[start:end], q_rope[start:end], cache, seq_len, blocks, context
            )
        return self._project(self.o_proj, out.view(T, H * self.v_dim), lora, "o_proj")

    def arena_bytes(self, elem: int) -> int:
        """What its native ops pack besides its linear layers: kv_b_proj's halves, a head after another (its own
        pack released)."""
        # W_UK[h] packed transposed ([rank, nope]), W_UV[h] as it is ([v, rank])
        per_head = panel_bytes(self.rank, self.nope, elem) + panel_bytes(self.v_dim, self.rank, elem)
        return self.num_heads * per_head + 128

    def write_ops(self, ops: OpWriter, i: int, src: str, kv) -> None:
        """The native step's ops of `forward`: q (q_proj, or q_a_proj -> its norm -> q_b_proj) and
        kv_a_proj_with_mqa -> kv_a_layernorm over c_kv (each + LoRA) -> the latent op (rotary, the cache's rows,
        the absorbed attention with kv_b_proj's halves and its LoRA) -> o_proj (+ LoRA), into "out"."""
        w = ops.w
        H, nope, rope, rank, v = self.num_heads, self.nope, self.rope, self.rank, self.v_dim
        q_width = H * (nope + rope)
        if self.q_proj is not None:  # (PEFT's q_proj: the q/k/v group, k and v empty)
            ops.linear(self.q_proj, src, "q", i, QKV, (q_width, 0, 0))
        else:
            ops.linear(self.q_a_proj, src, "q_a", i, ("q_a_proj",), (self.q_a_proj.out_features,))
            qn = self.q_a_layernorm
            w.rms_norm("q_a", "q_a", ops.ptr(qn.weight), qn.eps, self.q_a_proj.out_features)
            ops.linear(self.q_b_proj, "q_a", "q", i, ("q_b_proj",), (q_width,))
        ops.linear(self.kv_a_proj_with_mqa, src, "kv", i, ("kv_a_proj_with_mqa",), (rank + rope,))
        kn = self.kv_a_layernorm
        w.rms_norm("kv", "kv", ops.ptr(kn.weight), kn.eps, rank)
        # kv_b_proj's key half W_UK[h] [nope, rank] packed transposed (the latent query: q_nope W_UK), its value
        # half W_UV[h] [v, rank] as it is, a head after another
        kv_b = self.kv_b_proj.weight.detach().view(H, nope + v, rank)
        w_uk = ops.arena.put(
            lambda: torch.cat([cpu_native.pack(kv_b[h, :nope].T.contiguous()) for h in range(H)])
        )
        w_uv = ops.arena.put(
            lambda: torch.cat([cpu_native.pack(kv_b[h, nope:].contiguous()) for h in range(H)])
        )
        ops.release(self.kv_b_proj)
        table = ops.rope(i)
        w.latent_attention("q", "kv", "attn", H, nope, rope, rank, v, ops.ptr(table.cos), ops.ptr(table.sin),
                           kv[0].data_ptr(), w_uk.data_ptr(), w_uv.data_ptr(), self.scale, self.interleaved, i,
                           GROUP_OF[("kv_b_proj",)])  # fmt: skip
        ops.linear(self.o_proj, "attn", "out", i, ("o_proj",), (self.o_proj.out_features,))

    def _project(self, linear: Linear, x: torch.Tensor, lora: LoRABatch | None, name: str) -> torch.Tensor:
        """`linear`(x) and each row's adapter delta of the module `name` (PEFT's name; q_proj in the q/k/v group
        with k and v empty)."""
        y = linear(x)
        if lora is not None:
            group, sizes = (
                ((name, "k_proj", "v_proj"), (y.shape[1], 0, 0)) if name == "q_proj" else ((name,), None)
            )
            lora.add(y, x, self.layer_idx, group, sizes or (y.shape[1],))
        return y

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key half W_UK [H, nope, rank] and value half W_UV [H, v, rank]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _absorbed(self, q_nope, q_rope, cache: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        """Decode rows: q_nope W_UK (a latent query per head) beside q_rope attend over the cached rows as one
        shared key / value head; the output's latent part times W_UV. [n, H, v]."""
        w_uk, w_uv = self._kv_b()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [n, H, rank]
        o = latent_decode(q_latent.to(cache.dtype), q_rope.to(cache.dtype), cache, ctx, self.scale)
        return torch.bmm(o.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded(
        self, q_nope, q_rope, cache: torch.Tensor, seq_len: int, blocks: list[int], lora: LoRABatch | None
    ) -> torch.Tensor:
        """One sequence's new rows (its last len(q_nope) positions of `seq_len`): its cached c_kv through kv_b_proj
        (and its adapter's delta there: `lora`, one segment over the context) into per-head keys and values,
        causal attention in fp32 (queries in chunks bounding the scores' memory). [n, H, v]."""
        H, n = self.num_heads, q_nope.shape[0]
        rows = cache.index_select(0, torch.tensor(blocks, device=cache.device)).view(-1, cache.shape[-1])
        rows = rows[:seq_len]
        latent = rows[:, : self.rank].to(q_nope.dtype)
        kv = self._project(self.kv_b_proj, latent, lora, "kv_b_proj").view(seq_len, H, -1)
        k = torch.cat(
            [
                kv[..., : self.nope],
                rows[:, self.rank :].unsqueeze(1).expand(seq_len, H, self.rope).to(kv.dtype),
            ],
            dim=-1,
        )
        k, v = k.float().transpose(0, 1), kv[..., self.nope :].float().transpose(0, 1)  # [H, S, .]
        q = (torch.cat([q_nope, q_rope], dim=-1).float() * self.scale).transpose(0, 1)  # [H, n, qk]
        ctx_len = seq_len - n
        out = torch.empty(n, H, self.v_dim, dtype=q_nope.dtype, device=q_nope.device)
        chunk = max(1, _MAX_SCORE_ELEMS // (H * seq_len))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            keys = ctx_len + c1  # the chunk's last query sees keys up to here
            s = torch.matmul(q[:, c0:c1], k[:, :keys].mT)
            q_pos = torch.arange(ctx_len + c0, ctx_len + c1, device=q.device)[:, None]
            s.masked_fill_(torch.arange(keys, device=q.device)[None, :] > q_pos, float("-inf"))
            o = torch.matmul(s.softmax(dim=-1), v[:, :keys])
            out[c0:c1] = o.transpose(0, 1).to(out.dtype)
        return out


def latent_softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(the q / k head width), times YaRN's mscale(factor, mscale_all_dim) squared where the rotary is
    scaled with one (DeepSeek's long-context checkpoints), as transformers' `yarn_apply_mscale`."""

    scale = cfg.head_dim**-0.5
    scaling = cfg.rope_scaling or {}
    m_all = scaling.get("mscale_all_dim")
    factor = scaling.get("factor") or 1.0
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and m_all and factor > 1:
        m = 0.1 * m_all * math.log(factor) + 1.0
        scale *= m * m
    return scale
