"""Structured outputs' host cost a step: filling the allowed-token masks of R constrained rows (`Grammars.allowed`),
one matcher at a time and in xgrammar's worker threads, on a synthetic vocabulary of V random tokens (raw strings:
a worst case, most tokens undecided inside a JSON string). On a GPU the fill runs while the step's forward does.

usage: python benchmarks/structured_masks.py [--vocab 128000] [--rows 1,16,64] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main(argv=None):
    import xgrammar as xgr

    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128_000)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789{}\":,. "
    vocab = [chr(i) for i in range(33, 127)]
    vocab += ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(args.vocab)]
    vocab = list(dict.fromkeys(vocab))
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[0])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    t0 = time.perf_counter()
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    print(f"vocabulary {len(vocab)}: schema compiled in {1e3 * (time.perf_counter() - t0):.1f} ms")
    batch = xgr.BatchGrammarMatcher()
    for rows in map(int, args.rows.split(",")):
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
        for m in matchers:
            m.accept_string('{"name": "ab')  # inside a string: the widest choice of tokens
        bits = xgr.allocate_token_bitmask(rows, len(vocab))
        t0 = time.perf_counter()
        for _ in range(args.reps):
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bits, i)
        serial = (time.perf_counter() - t0) / args.reps
        t0 = time.perf_counter()
        for _ in range(args.reps):
            batch.batch_fill_next_token_bitmask(matchers, bits)
        threaded = (time.perf_counter() - t0) / args.reps
        print(f"{rows:4d} rows: one by one {1e3 * serial:7.2f} ms, threaded {1e3 * threaded:7.2f} ms a step")


if __name__ == "__main__":
    main()
