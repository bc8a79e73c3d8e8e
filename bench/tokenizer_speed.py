"""Router tokenization speed: the toy tokenizer before and after, and the Hugging Face tokenizer.
(Not named ``tokenize.py``: run as a script from bench/, it would shadow the standard library's
``tokenize``, which ``inspect`` imports.)

    PYTHONPATH=. python bench/tokenizer_speed.py [--chars 7400] [--prompts 400] [--before-ref 5e5a381]
        [--tokenizer ~/.cache/infernex-bench/tokenizer-32000]

Prompts are ~7.4k characters as in the router bench: one of 8 shared documents (~80% of the
text) followed by a question of fresh random words, so each prompt shares a long prefix with
others but is never seen twice. Every figure is per prompt, measured in one run on the same
prompts:

* ``SimpleTokenizer before``: the implementation at ``--before-ref`` (git), loaded from git.
* ``SimpleTokenizer after, cold``: a fresh tokenizer per pass (no memo yet), the worst case.
* ``SimpleTokenizer after, warm``: the steady state of a router (shared prefixes memoized).
* ``HF tokenizers``: the fixture byte-level BPE (tests/fixtures/tokenize), as ``request_to_ids``
  calls it (with BOS), and a chat request (template rendered once + encoded): each prompt encoded
  whole (as before simulator.piece_memo), then from memoized pieces (prompts with questions not
  seen before, and the steady state), as a list and as the ``uint32`` array the router asks for.
* ``tiktoken``: the same tokenizer encoded by tiktoken's BPE (:mod:`simulator.fast_bpe`, the
  router's ``tokenizer_fast``), whole and from memoized pieces; ``--tokenizer`` picks another
  ``tokenizer.json`` for the HF and tiktoken rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORDS = ["the", "router", "sends", "each", "request", "to", "engine", "that", "already", "holds", "its", "prefix", "in", "cache", "block", "token", "model", "prompt", "answer", "question", "document", "section", "table", "figure", "result", "method", "value", "shared", "Paris", "Berlin", "capital", "country", "river", "mountain", "weather", "report", "summary,", "value;", "(note)", "42", "2026", "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi"]


def make_prompts(n: int, chars: int, seed: int = 1) -> list[str]:
    rnd = random.Random(seed)

    def text(k: int) -> str:
        out, size = [], 0
        while size < k:
            w = rnd.choice(WORDS) if rnd.random() < 0.8 else f"w{rnd.randrange(10**6)}"
            out.append(w)
            size += len(w) + 1
        return " ".join(out)[:k]

    docs = [text(int(chars * 0.8)) for _ in range(8)]
    return [docs[i % 8] + "\n\nQuestion: " + text(chars - int(chars * 0.8) - 12) for i in range(n)]


def load_before(ref: str):
    src = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:simulator/tokenizer.py"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "tokenizer_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("tokenizer_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def per_prompt(fn, prompts, reps: int) -> float:
    """Median over ``reps`` passes of the mean time per prompt (µs)."""
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for p in prompts:
            fn(p)
        runs.append((time.perf_counter() - t) / len(prompts) * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=7400)
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "tests", "fixtures", "tokenize"),
                    help="the tokenizer.json (or its folder) of the HF rows (default: the small parity fixture; "
                    "bench/bench_tokenizer.py makes a 32k one)")
    ap.add_argument("--before-ref", default="5e5a381", help="git ref of the old tokenizer (default: the last "
                    "commit before session 5's change)")
    args = ap.parse_args()
    from simulator.tokenizer import HFTokenizer, SimpleTokenizer, request_to_ids

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    prompts = make_prompts(args.prompts, args.chars)
    fresh = make_prompts(args.prompts, args.chars, seed=2)  # same documents, unseen questions
    print(f"{len(prompts)} prompts of {args.chars} chars (80% one of 8 shared documents, 20% unique)")
    before = load_before(args.before_ref).SimpleTokenizer()
    after = SimpleTokenizer()
    assert all(before.encode(p) == after.encode(p) for p in prompts[:50]), "ids changed"
    rows = []
    b = per_prompt(before.encode, prompts, args.reps)
    rows.append((f"SimpleTokenizer before ({args.before_ref})", b))

    def cold(p):
        SimpleTokenizer().encode(p)

    rows.append(("SimpleTokenizer after, cold memo", per_prompt(cold, prompts, args.reps)))
    after.encode(prompts[0])
    rows.append(("SimpleTokenizer after, warm (unseen questions)", per_prompt(after.encode, fresh, 1)))
    rows.append(("SimpleTokenizer after, warm (steady state)", per_prompt(after.encode, prompts, args.reps)))
    fixture = args.tokenizer
    whole = HFTokenizer(fixture)
    whole.pieces = None  # every prompt encoded whole (the tokenizer before simulator.piece_memo)
    hf = HFTokenizer(fixture)
    assert hf.pieces is not None, hf.pieces_off

    def chat(tok, arr=False):  # arr: a uint32 array, as the router asks (request_to_ids(as_array=True))
        return lambda p: request_to_ids(tok, "chat", {"messages": [
            {"role": "system", "content": p[:5900]}, {"role": "user", "content": p[5900:]}]}, as_array=arr)

    def completion(tok, arr=False):
        return lambda p: request_to_ids(tok, "completions", {"prompt": p}, as_array=arr)

    for p in prompts[:50] + fresh[:50]:
        assert completion(hf)(p) == completion(whole)(p) and chat(hf)(p) == chat(whole)(p), "HF ids changed"
    rows.append(("HF tokenizers (fixture BPE), completion + BOS, whole", per_prompt(completion(whole), prompts, 1)))
    rows.append(("HF, memoized pieces, unseen questions", per_prompt(completion(hf), make_prompts(
        args.prompts, args.chars, seed=3), 1)))
    rows.append(("HF, memoized pieces, steady state", per_prompt(completion(hf), prompts, args.reps)))
    rows.append(("HF, memoized pieces, steady state, uint32 array", per_prompt(completion(hf, True), prompts,
                                                                              args.reps)))
    fast_whole = HFTokenizer(fixture, fast=True)  # tiktoken's BPE (the router's tokenizer_fast)
    assert fast_whole.fast_off is None, fast_whole.fast_off
    fast_whole.pieces = None
    fast = HFTokenizer(fixture, fast=True)
    for p in prompts[:50] + fresh[:50]:
        assert completion(fast_whole)(p) == completion(fast)(p) == completion(whole)(p), "tiktoken's ids differ"
    rows.append(("tiktoken BPE (tokenizer_fast), completion + BOS, whole", per_prompt(completion(fast_whole),
                                                                                      prompts, 1)))
    rows.append(("tiktoken, memoized pieces, unseen questions", per_prompt(completion(fast), make_prompts(
        args.prompts, args.chars, seed=4), 1)))
    rows.append(("tiktoken, memoized pieces, steady state, uint32 array", per_prompt(completion(fast, True),
                                                                                     prompts, args.reps)))
    rows.append(("HF, chat: template rendered once + encode, whole", per_prompt(chat(whole), prompts, 1)))
    rows.append(("HF, chat, memoized pieces, steady state, uint32 array", per_prompt(chat(hf, True), prompts,
                                                                                    args.reps)))
    for name, us in rows:
        print(f"{name:<52} {us:8.1f} us/prompt  {b / us:5.1f}x")


if __name__ == "__main__":
    main()
