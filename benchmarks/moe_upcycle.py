"""A Mixtral-architecture mixture of experts made from a trained dense Llama checkpoint (sparse upcycling), for
measuring the MoE paths on trained weights where no trained MoE checkpoint can be downloaded.

    python -m benchmarks.moe_upcycle [--model NAME|DIR] --out DIR [--experts 4] [--top-k 2] [--noise 0.1]

Each layer's MLP becomes --experts experts, each the dense gate/up/down plus Gaussian noise of --noise times
that matrix's own standard deviation (so the experts differ and the routing matters), and a router of random
Gaussian rows (seeded) picking --top-k of them per token; Mixtral renormalizes the top-k weights to sum to 1, so
with no noise the model would compute the dense one exactly whatever the routing. Attention, norms, embeddings
and the tokenizer are the dense checkpoint's. The checkpoint is written in Mixtral's original layout
(`block_sparse_moe.experts.N.w1/w2/w3`, `block_sparse_moe.gate`), which transformers and llama.cpp's
convert_hf_to_gguf.py both read. It is not a trained MoE: its experts are near-copies and its router is not
learned; what it gives is a trained model's peaked next-token distributions through real top-k routing.

--rotate turns the residual stream by a random orthogonal matrix Q, as QuaRot does (every RMSNorm's weight folded
into the projections it feeds, then those read x Q: W Q; the ones writing the residual, o_proj and the experts'
w2, Q^T W; the embedding table E Q; an untied lm_head): the same function, in weights off any quantization grid.
The default model's checkpoint is its Q4_1 GGUF file dequantized, so without it its projections re-quantize to
Q4_1 losslessly and a 4-bit measurement sees no weight error.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
MLP = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # Llama's MLP -> Mixtral's expert names


def rotate(weights: dict[str, torch.Tensor], config: dict, gen: torch.Generator) -> None:
    """The residual stream turned by a random orthogonal Q, in place (see the module's docstring)."""
    q, _ = torch.linalg.qr(torch.randn((config["hidden_size"], config["hidden_size"]), generator=gen))
    embed = weights["model.embed_tokens.weight"]
    lm_head = weights.pop("lm_head.weight", embed) * weights["model.norm.weight"]
    weights["lm_head.weight"] = (lm_head @ q).contiguous()
    weights["model.embed_tokens.weight"] = (embed @ q).contiguous()
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    config["tie_word_embeddings"] = False
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        for norm, readers in (("input_layernorm", (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj")),
                              ("post_attention_layernorm", (".block_sparse_moe.",))):  # fmt: skip
            gamma = weights[f"{layer}.{norm}.weight"]
            for name in [n for n in weights if n.startswith(layer + ".") and any(r in n for r in readers)]:
                if name.endswith((".w2.weight",)):
                    continue
                weights[name] = ((weights[name] * gamma) @ q).contiguous()
            weights[f"{layer}.{norm}.weight"] = torch.ones_like(gamma)
        for name in [
            n for n in weights if n.startswith(layer + ".") and n.endswith((".o_proj.weight", ".w2.weight"))
        ]:
            weights[name] = (q.T @ weights[name]).contiguous()


def upcycle(
    src: Path, out: Path, experts: int, top_k: int, noise: float, seed: int = 0, rotated: bool = False
) -> Path:
    dense = json.loads((src / "config.json").read_text())
    config = {k: dense[k] for k in CONFIG_KEYS if k in dense}
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                  num_experts_per_tok=top_k, sliding_window=None, router_aux_loss_coef=0.0,
                  output_router_logits=False, torch_dtype="float32")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, w in load_file(src / "model.safetensors").items():
        w = w.float()
        proj = name.split(".")[-2]
        if proj not in MLP:
            weights[name] = w.contiguous()
            continue
        prefix = name.rsplit(".mlp.", 1)[0] + ".block_sparse_moe"
        for e in range(experts):
            jitter = torch.randn(w.shape, generator=gen) * (noise * w.std().item())
            weights[f"{prefix}.experts.{e}.{MLP[proj]}.weight"] = (w + jitter).contiguous()
        if proj == "gate_proj":
            hidden = w.shape[1]
            weights[f"{prefix}.gate.weight"] = torch.randn((experts, hidden), generator=gen) / hidden**0.5
    if rotated:
        rotate(weights, config, gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the dense checkpoint (default: the default model)")
    ap.add_argument("--out", required=True, help="the MoE checkpoint's directory")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.1, help="each expert's noise, in its matrix's std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rotate", action="store_true", help="turn the residual stream by a random orthogonal Q")
    args = ap.parse_args(argv)
    from motet.engine.weights.model_store import resolve_model

    src = Path(resolve_model(args.model))
    print(upcycle(src, Path(args.out), args.experts, args.top_k, args.noise, args.seed, args.rotate))


if __name__ == "__main__":
    main()
