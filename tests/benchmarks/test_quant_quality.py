"""benchmarks/quant_quality.py's measurements on a tiny random model: the engine's perplexity against
Hugging Face transformers' cross-entropy on the same text, and a whole run (no lm-eval) over every format."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from benchmarks import quant_quality as qq
from motet.engine.llm import LLM
from motet.engine.tokenizer import load_tokenizer
from tests.engine.test_gguf_model_file import write_gguf_file
from tests.kernels.test_quantization import GGUF_TYPES, dequantized_checkpoint, quantizing_inputs
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
OPTIONS = dict(device="cpu", block_size=8, num_kv_blocks=256)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A GGUF file's derived config and tokenizer go to this test's own cache, never the user's."""
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def hf_perplexity(model_dir, ids: list[int], window: int) -> float:
    """exp of transformers' mean cross-entropy over each window's tokens after its first, on the int8
    model's meaning: the dequantized checkpoint, the projections' and lm_head's inputs rounded as motet's CPU
    product rounds them."""
    hf = quantizing_inputs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    nll, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), window):
            part = torch.tensor(ids[start : start + window])
            if len(part) < 2:
                continue
            logits = hf(part[None]).logits[0]
            nll += F.cross_entropy(logits[:-1], part[1:], reduction="sum").item()
            n += len(part) - 1
    return math.exp(nll / n)


@pytest.mark.parametrize("window", [None, 100])  # the whole slice in one window; windows of 100 tokens
def test_perplexity_matches_hf_cross_entropy(tiny, tmp_path, window):
    ids = load_tokenizer(tiny).encode(qq.TEXT.read_text()[:900])
    assert len(ids) > 250  # several windows of 100 (the last one shorter)
    llm = LLM(str(tiny), quantization="int8", **OPTIONS)
    got = qq.perplexity(llm, ids, window)
    size = window or len(ids)
    assert got["tokens"] == len(ids) - math.ceil(len(ids) / size)  # all but each window's first token
    want = hf_perplexity(dequantized_checkpoint(tiny, tmp_path / "ref", "int8"), ids, size)
    # Rounded inputs on a rounding boundary may round one step apart in the two implementations (see
    # tests/kernels/test_quantization.py): a few rows' logits move by a few hundredths, the mean log-likelihood far less.
    # Rounded inputs on a rounding boundary may round one step apart in the two implementations (see
    # tests/kernels/test_quantization.py): a few rows' logits move by a few hundredths, the mean log-likelihood by
    # about 1e-4 (a token scored against the wrong row would move it by whole nats).
    assert got["ppl"] == pytest.approx(want, rel=1e-3)
    assert got["nll_per_token"] == pytest.approx(math.log(want), abs=1e-3)


def test_greedy_agreement_counts_whole_outputs_and_common_prefixes():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = qq.agreement([[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]], ref)
    assert got["exact_share"] == pytest.approx(1 / 3)
    assert got["prefixes"] == [4, 2, 0] and got["mean_common_prefix"] == pytest.approx(2.0)


def test_a_run_over_every_format(tiny, tmp_path):
    """The script end to end on the tiny model and its GGUF file (lm-eval left out): each format against bf16
    and fp32, and the GGUF file read exactly as gguf-py dequantizes it."""
    gguf = write_gguf_file(tiny, tmp_path / "bare" / "tiny.gguf", GGUF_TYPES)
    out = tmp_path / "report"
    qq.main(["--model", str(tiny), "--gguf", str(gguf), "--no-lm-eval", "--text-tokens", "120",
             "--prompts", "3", "--max-tokens", "6", "--hf", "--out", str(out)])  # fmt: skip
    report = json.loads((out / "results.json").read_text())
    rows = {r["format"]: r for r in report["rows"]}
    assert list(rows) == ["bf16", "fp32", "int8", "int4", "gguf"]
    assert (
        rows["bf16"]["vs"]["bf16"]["ppl_ratio"] == 1
        and rows["bf16"]["vs"]["bf16"]["greedy"]["exact_share"] == 1
    )
    assert all(r["perplexity"]["tokens"] == 119 and set(r["vs"]) == {"bf16", "fp32"} for r in rows.values())
    # Against transformers fp32 on the checkpoint over the same text: motet in fp32 is the same model
    hf = report["hf"]
    assert hf["tokens"] == 119
    assert rows["fp32"]["vs_hf"]["ppl_ratio"] == pytest.approx(1, rel=1e-4)
    assert rows["fp32"]["vs_hf"]["top1_agreement"] >= 0.95
    assert all(0 <= r["vs_hf"]["top1_agreement"] <= 1 for r in rows.values())
    check = report["gguf_logits"]
    assert check["weights_max_abs_diff"] == 0 and check["read_right"]
    assert check["rounded_inputs"]["mean_abs"] < 0.1 * check["plain"]["logit_scale"]
    assert "## Against bf16" in (out / "summary.md").read_text()
