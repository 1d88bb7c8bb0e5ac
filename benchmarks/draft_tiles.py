"""The drafter's step through the decoder kernels under several ``Tiles``, measured side by side: the draft
step (the context rows' keys and values, the block's layers, the final norm and the head) of a random
drafter of the served shape over a random target of the embedded target's shape.

    python benchmarks/draft_tiles.py --out draft_tiles.json     # GPU: the table and its JSON
    python benchmarks/draft_tiles.py --smoke                    # CPU (Triton's interpreter): a tiny shape

The drafter's kernels take the target's block tiles (``DraftKernels.tiles``), chosen on the target's [1,8]
and [1,16] steps: a drafter's layers are few and its qkv programs one head wide (its heads are normalised),
so its best tiles may differ. For each variant (``kernel_tiles.VARIANTS``): the step captured as a CUDA
graph of --reps calls and replayed (median of --replays, per call), the kernels' device time per step
under the profiler, and its drafted logits against the default tiles' (the same argmax in every slot, the
values within bf16's rounding). Timing does not depend on the weights: random ones, nothing to carry.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import

import torch

from dflashkit.infer.draft_kernels import draft_kernels, kernel_draft_step, write_prompt_context
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.slot_decoder import DecoderWeights
from report import write_json

DEFAULT_VARIANTS = "default,qsplit8,qusplit8,qusplit2,ksplit8,ksplit2,block16,block64,inner256"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="names of kernel_tiles.VARIANTS")
    p.add_argument("--layers", type=int, default=3, help="drafter layers (the served drafter's: 3)")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--target-layers", type=int, default=5, help="target layers the drafter reads")
    p.add_argument("--context", type=int, default=400, help="context rows in the drafter's cache (400)")
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20, help="draft steps a captured graph holds")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--profile-calls", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, a tiny shape")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    from kernel_tiles import VARIANTS, kernel_ms, random_model, replay_ms

    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        args.context, args.capacity, args.layers, args.target_layers = 20, 64, 2, 2
    model = random_model(smoke, dev.type, dtype)
    w = DecoderWeights.from_hf(model)
    n_target = model.config.num_hidden_layers
    ids = [round(i * (n_target - 1) / max(1, args.target_layers - 1)) for i in range(args.target_layers)]
    cfg = config_for_target(
        model.config,
        num_layers=args.layers,
        block_size=args.block,
        mask_token_id=w.vocab_size - 1,
        target_layer_ids=ids,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(dev, dtype).eval()
    gen = torch.Generator().manual_seed(1)
    width = args.target_layers * w.embed.shape[1]
    prompt = (torch.randn(1, args.context, width, generator=gen) * 0.5).to(dev, dtype)
    rows = (torch.randn(1, args.block, width, generator=gen) * 0.5).to(dev, dtype)
    block = torch.full((1, args.block), w.vocab_size - 1, device=dev)
    block[0, 0] = 17
    row_start = torch.tensor([args.context], device=dev)
    block_start = torch.tensor([args.context + 3], device=dev)  # a round that kept 2 drafts: rows overlap

    results, reference = [], None
    for name in args.variants.split(","):
        dk = draft_kernels(drafter, w, args.capacity)
        dk.tiles = VARIANTS[name]
        write_prompt_context(dk, prompt)
        out = torch.empty(args.block - 1, w.vocab_size, dtype=torch.float32, device=dev)

        def step(dk=dk, out=out) -> None:
            kernel_draft_step(dk, rows, row_start, block, block_start, out)

        step()
        if reference is None:
            reference = out.clone()
        same = bool(torch.equal(out.argmax(-1), reference.argmax(-1)))
        err = float((out - reference).abs().max())
        row: dict = {"variant": name, "tiles": asdict(dk.tiles), "same_argmax": same, "max_abs_diff": err}
        if not smoke:
            row["step_ms"] = replay_ms(step, args.replays, args.reps)
            row["kernel_ms"] = kernel_ms(step, args.profile_calls)
            print(
                f"{name:10s} draft step {row['step_ms']:.4f} ms (kernels {sum(row['kernel_ms'].values()):.4f}: "
                + " ".join(f"{k} {v:.4f}" for k, v in row["kernel_ms"].items())
                + f")  argmax same: {same}, max |diff| {err:.3g}",
                flush=True,
            )
        results.append(row)
    if smoke:  # float32: every variant's drafts are the default's (a tile that broke a step would show here)
        print(f"smoke: {len(results)} variants ran in Triton's interpreter")
        wrong = [r["variant"] for r in results if not r["same_argmax"] or r["max_abs_diff"] > 1e-3]
        if wrong:
            raise SystemExit(f"drafts unlike the default tiles' under: {', '.join(wrong)}")
    result = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton's interpreter)",
        "torch": torch.__version__,
        "layers": args.layers,
        "block": args.block,
        "context": args.context,
        "variants": results,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
