"""GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2's, Mistral 7B's, TinyLlama's,
Gemma's, Phi-3's files), served bare: the tokenizer motet builds from the file's tokens, scores and token types
(motet/engine/weights/gguf_spm.py) encodes as `sentencepiece` itself does, id for id, and decodes back.

Each tiny checkpoint's tokenizer.model is trained here by `sentencepiece` as Llama 2's and Gemma's were (BPE, byte
fallback, identity normalization, digits split; Llama's with SentencePiece's dummy prefix, Gemma's without it and
with user-defined newline, space-run and tab pieces), beside a tokenizer_config.json as those models' are; the file is
written as llama.cpp's convert_hf_to_gguf.py writes one (`add_sentencepiece_vocab`: its _set_vocab_sentencepiece,
Gemma's add_space_prefix false)."""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path

import gguf
import pytest

from motet.engine.llm import LLM
from tests.engine.test_gguf_model_file import OPTIONS, write_gguf_file
from tests.live_server import ThreadServer, assert_chat_prompt_ids
from tests.models.test_gguf_families import FAMILIES, write_family_gguf
from tests.tiny_models import CORPUS, build_tiny_model

spm = pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# the training text: the tiny models' corpus and lines with what the models' texts hold (numbers, code, accents)
SPM_CORPUS = (
    sorted(set(CORPUS))
    + [
        "A tokenizer turns text into pieces; each piece has an id and a score.",
        "In 1969, 3 astronauts flew 384400 km to the Moon and back in 8 days.",
        "Les élèves étudient la géographie, l'histoire et les mathématiques.",
        "Der schnelle braune Fuchs springt über den faulen Hund.",
        "for i in range(10):  print(i * i)  # squares",
        "SELECT name, count(*) FROM users WHERE age > 21 GROUP BY name;",
        "She sells sea shells by the sea shore; the shells she sells are sea shells.",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -42 +7",
    ]
    * 10
)
# Llama 2's special ids (no padding) and Gemma's; Gemma's control and user-defined pieces (its real ones: turns, runs
# of newlines and spaces, tabs, HTML tags); their chat templates
LLAMA_IDS = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
GEMMA_IDS = dict(
    pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>"
)
GEMMA_CONTROL = ["<start_of_turn>", "<end_of_turn>"]
GEMMA_USER_DEFINED = ["\n", "\n\n", "\n\n\n", "▁▁", "▁▁▁", "▁▁▁▁", "\t", "\t\t", "<table>"]
LLAMA_TEMPLATE = (  # Llama 2's, less its system prompt
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 12345",
    " one leading space",
    "   three leading spaces, two  inner   runs    and a trailing one ",
    "line one\nline two\r\n\nline four\n\n\n\nend\n",
    "\ttabbed\t\tcolumns\t",
    "digits 1234567890, 3.14159 and 2024-11-26T12:00:00Z",
    "Ünïcödé façade naïve café — coöperate, Straße",
    "東京タワー 北京欢迎你 한국어 Привет Ελληνικά",  # characters the corpus lacks: bytes
    "emoji 🎵🎶 👩‍👩‍👧 🇫🇷 ✨",
    "def add(a, b):\n    return a + b  # sum\n",
    '{"name": "motet", "tokens": [1, 2, 3], "ok": true}',
    "<table> rows </table>",
    "x",
    " ",
    "\n",
]


def train_sentencepiece(*, dummy_prefix: bool, ids: dict, control=(), user_defined=()) -> bytes:
    """A SentencePiece BPE model trained on SPM_CORPUS with Llama 2's and Gemma's training options."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=700,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        control_symbols=list(control),
        user_defined_symbols=list(user_defined),
        minloglevel=2,
        **ids,
    )
    return model.getvalue()


def spm_checkpoint(path: Path, family: str) -> tuple[Path, spm.SentencePieceProcessor]:
    """A tiny checkpoint of `family` ("llama" or "gemma3") whose tokenizer is a trained tokenizer.model with the
    family's tokenizer_config.json (Gemma's added tokens: its control and user-defined pieces, spaces as U+2581)."""
    gemma = family == "gemma3"
    model = train_sentencepiece(
        dummy_prefix=not gemma,
        ids=GEMMA_IDS if gemma else LLAMA_IDS,
        control=GEMMA_CONTROL if gemma else (),
        user_defined=GEMMA_USER_DEFINED if gemma else (),
    )
    sp = spm.SentencePieceProcessor(model_proto=model)
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}
    ids = {k: i for k, i in ids.items() if i >= 0}
    overrides = dict(FAMILIES[family]) if gemma else {}
    overrides |= dict(vocab_size=sp.vocab_size(), bos_token_id=ids["bos"], eos_token_id=ids["eos"])
    if gemma:
        overrides["pad_token_id"] = ids["pad"]
    source = build_tiny_model(path, arch=family, **overrides)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
    ):
        (source / name).unlink(missing_ok=True)
    (source / "tokenizer.model").write_bytes(model)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["eos"]}))
    added = {i: sp.id_to_piece(i) for i in range(sp.vocab_size()) if sp.is_control(i) or sp.is_unknown(i)}
    if gemma:
        added |= {sp.piece_to_id(p): p for p in GEMMA_USER_DEFINED}
    config = {
        "tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        **{f"{k}_token": sp.id_to_piece(i) for k, i in ids.items()},
        "added_tokens_decoder": {
            str(i): {"content": p, "special": sp.is_control(i) or sp.is_unknown(i)} for i, p in added.items()
        },
    }
    config["chat_template"] = GEMMA_TEMPLATE if gemma else LLAMA_TEMPLATE
    (source / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return source, sp


def add_sentencepiece_vocab(
    writer, model_dir: Path, vocab_size: int, space_prefix: bool | None = None
) -> None:
    """The vocabulary as convert_hf_to_gguf.py's _set_vocab_sentencepiece writes it (_create_vocab_sentencepiece:
    each piece with its score and type, [PADi] UNUSED past the model; tokenizer_config.json's added_tokens_decoder
    CONTROL where special, else USER_DEFINED with their U+2581 as spaces, scored -1000), gguf-py's SpecialVocab for
    the special ids, add_bos / add_eos and the chat template; `space_prefix` as a family's converter adds it (Gemma's
    False)."""
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    T = gguf.TokenType
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [T.UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        kind = T.NORMAL
        if sp.is_unknown(i):
            kind = T.UNKNOWN
        elif sp.is_control(i):
            kind = T.CONTROL
        elif sp.is_unused(i):
            kind = T.UNUSED
        elif sp.is_byte(i):
            kind = T.BYTE
        tokens[i], scores[i], types[i] = sp.id_to_piece(i).encode(), sp.get_score(i), kind
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for i, data in config.get("added_tokens_decoder", {}).items():
        i, text = int(i), data["content"]
        if data.get("special"):
            types[i] = T.CONTROL
        else:
            text, types[i] = text.replace("\u2581", " "), T.USER_DEFINED
        tokens[i], scores[i] = text.encode(), -1000.0
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    if space_prefix is not None:
        writer.add_add_space_prefix(space_prefix)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def spm_file(request, tmp_path_factory) -> tuple[str, Path, Path, spm.SentencePieceProcessor]:
    """(family, its GGUF file alone in a directory, the source checkpoint, its SentencePiece processor)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    source, sp = spm_checkpoint(tmp / "source", family)
    out = tmp / "bare" / f"{family}-spm.gguf"
    if family == "llama":
        path = write_gguf_file(source, out, {}, vocab=add_sentencepiece_vocab)
    else:

        def vocab(writer, model_dir, vocab_size):  # Gemma3Model.set_vocab
            add_sentencepiece_vocab(writer, model_dir, vocab_size, space_prefix=False)

        path = write_family_gguf(source, out, "gemma3", vocab=vocab)
    return family, path, source, sp


@pytest.fixture(scope="module")
def spm_llm(spm_file, tmp_path_factory) -> LLM:
    mp = pytest.MonkeyPatch()
    mp.setenv("MOTET_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield LLM(str(spm_file[1]), compile_step=False, **OPTIONS)
    finally:
        mp.undo()


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Texts of the corpus's words and other characters (accents, CJK, emoji, controls' neighbours), runs of
    spaces, newlines and tabs, in random order: where ties between merges or byte fallback would show."""
    rng = random.Random(seed)
    words = sorted({w for line in SPM_CORPUS for w in line.split()})
    odd = list("éüß東京🎵👩\u200d\r0123456789.,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`")
    gaps = [" ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\n "]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.55:
                parts.append(rng.choice(words))
            elif kind < 0.75:
                parts.append("".join(rng.choice(odd) for _ in range(rng.randint(1, 4))))
            else:
                parts.append(rng.choice(gaps))
            if rng.random() < 0.6:
                parts.append(" ")
        out.append("".join(parts))
    return out


def test_file_encodes_as_sentencepiece_id_for_id(spm_file, spm_llm):
    """BOS, then sentencepiece's own ids for the text (its byte fallback for characters it lacks, the dummy
    prefix where the family has one, Gemma's user-defined pieces whole); decoding gives the text back, as
    sentencepiece's decode does."""
    family, _, _, sp = spm_file
    tok = spm_llm.tokenizer
    assert tok.vocab_size == sp.vocab_size()
    for text in TEXTS + random_texts(300):
        want = sp.encode(text)
        assert tok.encode(text) == [sp.bos_id(), *want], (family, text)
        assert tok.decode([sp.bos_id(), *want]) == sp.decode(want) == text, (family, text)
    assert spm_llm.engine.model_config.bos_token_id == sp.bos_id()
    # EOS, and Gemma's end of turn, which its file names by its text only (llama.cpp ends there too; Gemma 3's own
    # generation_config.json says [<eos>, <end_of_turn>])
    ends = {sp.eos_id()} | ({sp.piece_to_id("<end_of_turn>")} if family == "gemma3" else set())
    assert spm_llm.engine.eos_token_ids == ends
    assert any(sp.is_byte(i) for i in tok.encode(TEXTS[9]))  # (the emoji fell back to bytes)


def test_streamed_text_is_sentencepieces_decoding(spm_file, spm_llm):
    """Greedy output streamed through the incremental detokenizer: its text is sentencepiece's decoding of its ids
    (spaces before words kept, bytes joined into their characters)."""
    from motet.engine.sampling_params import SamplingParams

    _, _, _, sp = spm_file
    prompts = [spm_llm.tokenizer.encode(t) for t in TEXTS[:4]]
    outs = spm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for out in outs:
        ids = [i for i in out.token_ids if not sp.is_control(i)]
        if any(sp.is_byte(i) for i in ids) and "\ufffd" in sp.decode(ids):
            continue  # (random weights: an unfinished character at the end reads differently)
        assert out.text == sp.decode(ids)


def reference_chat_ids(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """A rendered chat encoded as llama.cpp encodes a prompt: its control tokens whole, each stretch of text between
    them by sentencepiece (with its dummy prefix where the vocabulary has one: llama.cpp's space before each)."""
    control = [sp.id_to_piece(i) for i in range(sp.vocab_size()) if sp.is_control(i)]
    ids = []
    for part in re.split("(" + "|".join(map(re.escape, control)) + ")", text):
        ids += [sp.piece_to_id(part)] if part in control else sp.encode(part) if part else []
    return ids


def test_served_chat_renders_the_files_template(spm_file, tmp_path):
    """The file's `tokenizer.chat_template` is what `motet serve FILE.gguf` renders: /tokenize's ids of a chat and
    a chat completion's prompt tokens are the template's rendering (transformers' jinja) encoded as llama.cpp
    encodes it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    family, path, _, sp = spm_file
    messages = [
        {"role": "user", "content": "Count to 3:  1 2 3 🎉"},
        {"role": "assistant", "content": "1\n2\n3"},
        {"role": "user", "content": "Now\tthe <table> of\n\nfour."},
    ]
    template = GEMMA_TEMPLATE if family == "gemma3" else LLAMA_TEMPLATE
    (rendered,), _ = render_jinja_template(
        [messages],
        chat_template=template,
        add_generation_prompt=True,
        bos_token=sp.id_to_piece(sp.bos_id()),
        eos_token=sp.id_to_piece(sp.eos_id()),
    )
    want = reference_chat_ids(sp, rendered)
    assert want.count(sp.bos_id()) == (2 if family == "llama" else 1)
    server = ThreadServer(
        "--model", str(path), "--threads", "1", "--max-model-len", "512", "--data-dir", str(tmp_path / "data")
    )
    try:
        client = assert_chat_prompt_ids(server.url, path.stem, messages, want)
        if family == "gemma3":  # the model's end of turn ends its answer
            end = sp.piece_to_id("<end_of_turn>")
            reply = client.completions.create(
                model=path.stem, prompt=rendered, max_tokens=8, extra_body={"allowed_token_ids": [end]}
            )
            assert (reply.choices[0].finish_reason, reply.choices[0].text) == ("stop", "")
            assert reply.usage.completion_tokens == 1
    finally:
        server.stop()
