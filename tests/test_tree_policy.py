"""benchmarks/tree_policy.py: a trace replayed under a policy gives the rounds that decoding with that policy
gives, round for round (the embedded target and the drafter in git, float32, greedy)."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tree_policy  # noqa: E402

DRAFTER = ROOT / "benchmarks" / "drafters" / "embedded-gpu-more"


@pytest.fixture(scope="module")
def pair():
    from dflashkit.model.checkpoint import load_drafter
    from dflashkit.target.hf import TargetModel

    target = TargetModel.load("embedded", dtype=torch.float32, device="cpu")
    drafter = load_drafter(DRAFTER, target, dtype=torch.float32, device="cpu", verify=False).eval()
    return target, drafter


def test_a_replayed_trace_gives_the_decoded_rounds(pair):
    from dflashkit.infer.speculative import Stopper, speculative_generate

    target, drafter = pair
    from dflashkit.data.chat import generation_prompt_ids
    from dflashkit.target.tokenizer import serving_tokenizer

    tok = serving_tokenizer(target.path)
    messages = [{"role": "user", "content": "List three uses of a paperclip."}]
    prompt = generation_prompt_ids(tok, messages, enable_thinking=False)
    eos = {tok.eos_token_id}
    max_new = 40
    trace = tree_policy.trace_response(target, drafter, prompt, max_new, eos)
    assert trace["one_pass_agreement"] == 1.0
    for budget, policy in ((None, tree_policy.chain_policy), (6, tree_policy.product_policy)):
        decoded = speculative_generate(
            target, drafter, prompt, max_new, stopper=Stopper(eos), tree_budget=budget
        )
        replayed = tree_policy.replay_response(trace, policy, budget or 0, max_new, eos)
        assert replayed == decoded.accept_lengths
        assert max(replayed) > 2  # rounds that accepted drafts, not a drafter that accepts nothing
    # the served build replayed by the policy's own best-first search: the same rounds
    best_first = tree_policy.replay_response(
        trace, lambda p, b: tree_policy.best_first(lambda d, r, q, m: q, p, b), 6, max_new, eos
    )
    assert best_first == tree_policy.replay_response(trace, tree_policy.product_policy, 6, max_new, eos)
