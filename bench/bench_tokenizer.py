"""A tokenizer.json of a realistic size for the router benches, made on this machine (no download).

    python -P bench/bench_tokenizer.py [--vocab 32000] [--out DIR]   # prints the tokenizer.json path

The test fixture (tests/fixtures/tokenize) is a byte-level BPE of 457 tokens: it cuts text into
about 1.5 characters a token and spends far more CPU per character than a model's tokenizer.
This one is a byte-level BPE with Llama 3's pre-tokenizer (its Split regex, then ByteLevel), a
32k vocabulary and a BOS post-processor, trained on the Python standard library's sources on this
machine (English comments and docstrings, and code). On the benches' prompts it gives about
4 characters a token, as Llama and Qwen tokenizers do on English text. Made once and kept in the
bench cache (``~/.cache/infernex-bench/tokenizer-<vocab>``, or ``--out``); the corpus is the
interpreter's own library, so the same Python version makes the same tokenizer.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

# Llama 3's pre-tokenizer regex (its tokenizer.json: "pre_tokenizer" -> Split -> pattern)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CACHE = Path(os.environ.get("INFERNEX_BENCH_CACHE", Path.home() / ".cache" / "infernex-bench"))


def corpus(limit_bytes: int = 24 << 20):
    """The standard library's .py files, in a fixed order, up to ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    n = 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        n += len(text)
        yield text
        if n >= limit_bytes:
            return


def build(vocab: int, out: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tmp = out / "tokenizer.json.tmp"
    tok.save(str(tmp))
    os.replace(tmp, path)
    return path


def bench_tokenizer(vocab: int = 32000, out: Path | None = None) -> Path:
    """The tokenizer.json (made the first time)."""
    out = out or CACHE / f"tokenizer-{vocab}"
    path = out / "tokenizer.json"
    return path if path.is_file() else build(vocab, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = bench_tokenizer(args.vocab, args.out)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tokenizer_speed import make_prompts
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    p = make_prompts(1, 7400)[0]
    n = len(tok.encode(p).ids)
    print(f"{path} (vocab {tok.get_vocab_size()}; a 7,400-character bench prompt is {n} tokens, "
          f"{len(p) / n:.1f} characters a token)")


if __name__ == "__main__":
    main()
