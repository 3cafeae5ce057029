"""How far apart may two bf16 paths put a prompt's scores? The sequences of
`tests/engine/test_gpu_engine.py::test_scoring_beside_graphed_decodes` scored three ways on a tiny model: packed
(`prompt_logprobs_batch` at a 64-token step budget, as the test scores them), each sequence in a forward of its own
(the test's reference), and by the fp32 engine (the truth both approximate). Printed per sequence: the max
|logprob difference| of packed vs own, and of each against fp32, over every scored position.

If packed and own are each about as far from fp32 as from each other, their difference is bf16 rounding of two paths
(the 53rd session's rows path at <= 16 rows met 0.053 against the test's bound of 0.05 on minimax_m2).

usage: python scripts/gpu_diag_scoring.py [--family minimax_m2]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: moelora, tests.helpers
from tests.helpers.gpu_engine import FAMILIES, gpu_engine, tiny_adapters, tiny_model, workload  # noqa: E402

SEQ_ADAPTERS = ["a3", None, "a2", "a1", "a0", "a2"]  # the test's


def own_forward(eng, seqs, names) -> list[torch.Tensor]:
    """Each sequence's logprobs of its own tokens (position p scores token p; position 0 none) from its own forward."""
    out = []
    for s, n in zip(seqs, names, strict=True):
        lp = eng.prompt_logits([s], [n])[0].float().log_softmax(-1)
        out.append(torch.tensor([lp[p - 1, s[p]].item() for p in range(1, len(s))]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="minimax_m2", choices=FAMILIES)
    args = ap.parse_args()
    seqs = workload(n=5, seed=1)[0] + [list(range(3, 203))]
    width = max(len(s) for s in seqs)
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_model(args.family, dtype=dtype)
        adapters = tiny_adapters(model, args.family)
        name = str(dtype).split(".")[-1]
        eng = gpu_engine(model, adapters, max_loras=2, max_num_batched_tokens=64, dtype=name)
        rows = eng.prompt_logprobs_batch([(s, n, 2) for s, n in zip(seqs, SEQ_ADAPTERS, strict=True)])
        runs[f"packed {name}"] = [torch.tensor([r[p][0] for p in range(1, len(r))]) for r in rows]
        whole = gpu_engine(model, adapters, max_loras=2, max_num_batched_tokens=width, dtype=name)
        runs[f"own {name}"] = own_forward(whole, seqs, SEQ_ADAPTERS)
    truth = runs["own float32"]

    def gap(a: str, b: str | None, i: int) -> float:
        return (runs[a][i] - (truth[i] if b is None else runs[b][i])).abs().max().item()

    for i, s in enumerate(seqs):
        print(f"{args.family} seq {i} ({len(s)} tokens): packed vs own bf16 "
              f"{gap('packed bfloat16', 'own bfloat16', i):.4f}; vs fp32: packed "
              f"{gap('packed bfloat16', None, i):.4f}, own {gap('own bfloat16', None, i):.4f}, "
              f"fp32 packed vs own {gap('packed float32', None, i):.2e}", flush=True)


if __name__ == "__main__":
    main()
