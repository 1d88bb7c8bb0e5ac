"""The slot generator (`prepare`'s own batched decoder) against transformers on tiny random targets:
the forward pass of each supported architecture, greedy replies token for token with continuous refill
and chunked prefill, and the sampler's distribution."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflashkit.data import generation
from dflashkit.data.generation import Reply, Request, cut_reply
from dflashkit.data.generator import SlotGenerator, SlotSettings, sample
from dflashkit.errors import DflashkitError
from dflashkit.target.slot_decoder import DecoderWeights, SlotCache, forward

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),  # q/k norms, head_dim != hidden/heads
}
EOS = list(range(3, 97, 9))  # enough end tokens that random tiny models stop often


def tiny(arch: str, seed: int = 0) -> Any:
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**SMALL, **extra)).eval()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_forward_equals_transformers(arch: str) -> None:
    """Prefill two rows into slots 2 and 0 in chunks of different sizes, then decode token by token:
    every position's logits equal the transformers model's (fp32 rounding)."""
    model = tiny(arch)
    w = DecoderWeights.from_hf(model)
    cache = SlotCache(w, slots=3, capacity=64)
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
        slots = torch.tensor([2, 0])
        got = [forward(w, cache, ids[:, :5], slots, torch.tensor([0, 0]), torch.tensor([4, 2]), kv_len=16)]
        want = [torch.stack([ref[0, 4], ref[1, 2]])]
        got.append(
            forward(w, cache, ids[:, 5:9], slots, torch.tensor([5, 5]), torch.tensor([3, 3]), kv_len=16)
        )
        want.append(ref[:, 8])
        for t in range(9, 12):
            step = forward(
                w,
                cache,
                ids[:, t : t + 1],
                slots,
                torch.tensor([t, t]),
                torch.zeros(2, dtype=torch.long),
                kv_len=t + 1,
            )
            got.append(step)
            want.append(ref[:, t])
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


class ListSource(generation.ListSource):
    """A fixed list of requests; each reply recorded once. `follow_up` adds a second round to each
    request when it is answered (as a multi-turn conversation does)."""

    def __init__(self, requests: list[Request], follow_up: bool = False):
        super().__init__(requests)
        self.follow_up = follow_up

    def complete(self, request: Request, reply: Reply) -> None:
        super().complete(request, reply)  # a second reply to one request raises
        if self.follow_up and not request.key.endswith("#1"):
            prompt = request.prompt_ids + tuple(reply.ids) + (7, 8, 9)
            self.ready.append(Request(request.key + "#1", prompt, request.max_new_tokens))


def greedy_reference(model: Any, request: Request) -> Reply:
    """Greedy decoding by definition: the argmax of a full forward pass over the prompt and the reply so
    far, token by token (no cache)."""
    ids = list(request.prompt_ids)
    with torch.no_grad():
        for _ in range(request.max_new_tokens):
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
            if ids[-1] in EOS:
                break
    return cut_reply(ids[len(request.prompt_ids) :], EOS, request.max_new_tokens)


def random_requests(n: int, seed: int = 1) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 40, (), generator=g))
        prompt = tuple(torch.randint(6, 97, (length,), generator=g).tolist())
        out.append(Request(f"r{i}", prompt, max_new_tokens=int(torch.randint(1, 24, (), generator=g))))
    return out


@pytest.mark.parametrize(
    ("arch", "fixed", "packed"),
    [("llama", False, False), ("qwen3", False, False), ("llama", True, False), ("qwen3", True, True)],
)
def test_greedy_replies_equal_transformers_generate(arch: str, fixed: bool, packed: bool) -> None:
    """More requests than slots (continuous refill), prompts longer than a prefill chunk, replies that
    end on either end token or at their length, a second round asked when the first is answered. Fixed
    shapes (as CUDA graphs run them): padded rows, chunks and key buckets, three steps per look. Packed:
    the prompts of a pass end to end (passes of at most 48 tokens: a longer prompt passes alone)."""
    model = tiny(arch)
    requests = random_requests(23)
    settings = SlotSettings(
        slots=4,
        capacity=128,
        prefill_rows=3,
        max_chunk=16,
        steps_per_sync=3,
        packed_prefill=packed,
        packed_tokens=48,
    )
    gen = SlotGenerator.create(model, EOS, settings, fixed_shapes=fixed)
    source = ListSource(requests, follow_up=True)
    stats = gen.run(source)
    assert len(source.replies) == 2 * len(requests) == stats.requests
    followups = [
        Request(r.key + "#1", r.prompt_ids + tuple(source.replies[r.key].ids) + (7, 8, 9), r.max_new_tokens)
        for r in requests
    ]
    for r in requests + followups:
        assert source.replies[r.key] == greedy_reference(model, r), r.key
    replies = list(source.replies.values())
    assert any(x.finished for x in replies) and any(not x.finished for x in replies)
    assert stats.new_tokens == sum(len(x.ids) for x in replies)
    assert 0 < stats.extra["slot_occupancy"] <= 1


def test_packed_refills_wait_for_a_sixteenth_of_the_slots() -> None:
    """A packed pass costs about the same for few prompts as for many (its launches), so with fixed
    shapes packed refills wait for slots // 16 free slots and a pass is bounded by its prompt tokens
    alone, not by `prefill_rows`; replies stay the target's greedy ones."""
    model = tiny("llama")
    settings = SlotSettings(
        slots=32, capacity=96, prefill_rows=2, max_chunk=16, steps_per_sync=2, packed_prefill=True,
        packed_tokens=64,
    )  # fmt: skip
    gen = SlotGenerator.create(model, EOS, settings, fixed_shapes=True)
    assert gen._refill_at() == 2
    held = [Request(str(i), tuple(range(1, 21)), 4) for i in range(7)]  # 20 prompt tokens each
    assert [len(g) for g in gen._prefill_groups(held)] == [3, 3, 1]
    padded = SlotGenerator.create(model, EOS, replace(settings, packed_prefill=False), fixed_shapes=True)
    assert padded._refill_at() == 1 and [len(g) for g in padded._prefill_groups(held)] == [2, 2, 2, 1]
    requests = random_requests(40)
    source = ListSource(requests)
    gen.run(source)
    for r in requests:
        assert source.replies[r.key] == greedy_reference(model, r), r.key


@pytest.mark.parametrize("packed", [False, True])
def test_refills_launched_behind_decode_steps_give_the_same_replies(
    packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fixed shapes, a refill while replies run is launched behind the next group of decode steps
    (its slots are free in that group) and seated after the group's look: greedy and sampled replies, and
    samples of one prompt sharing its prefill, are those of the eager loop, which refills before decoding."""
    model = tiny("llama")
    requests = [
        Request(
            f"{r.key}.{k}",
            r.prompt_ids,
            4 + (5 * i + k) % 11,
            temperature=(i + k) % 2 * 1.0,
            top_p=0.9,
            seed=5 * i + k,
        )
        for i, r in enumerate(random_requests(12, seed=9))
        for k in range(2)
    ]
    settings = SlotSettings(
        slots=8, capacity=96, prefill_rows=4, max_chunk=16, steps_per_sync=2, packed_prefill=packed
    )
    replies = {}
    for fixed in (False, True):
        gen = SlotGenerator.create(model, EOS, settings, fixed_shapes=fixed)
        behind: list[bool] = []

        def decode_group(*a: Any, _group: Any = gen._decode_group, _seen: list = behind, **k: Any) -> Any:
            _seen.append(k.get("behind") is not None)
            return _group(*a, **k)

        monkeypatch.setattr(gen, "_decode_group", decode_group)
        source = ListSource(requests)
        stats = gen.run(source)
        assert stats.extra["shared_prompt_tokens"] > 0
        assert any(behind) == fixed  # the eager loop never launches a refill behind steps
        replies[fixed] = source.replies
    assert replies[True] == replies[False]


def test_reply_that_ends_at_its_first_token() -> None:
    model = tiny("llama")
    reqs = random_requests(6)
    ref = {r.key: greedy_reference(model, r) for r in reqs}
    one = [Request(r.key, r.prompt_ids, 1) for r in reqs]  # every reply is its first token
    source = ListSource(one)
    SlotGenerator.create(model, EOS, SlotSettings(slots=2, capacity=64)).run(source)
    assert {k: v.ids for k, v in source.replies.items()} == {k: v.ids[:1] for k, v in ref.items()}


def look_reference(
    ring: torch.Tensor, count: list[int], budget: list[int], live: list[bool]
) -> tuple[list[int], list[bool]]:
    """What a group of steps does to each slot, one slot and one step at a time: a live reply takes the
    new tokens until its budget is full or it took an end token."""
    counts, ended = list(count), [False] * len(count)
    for s in range(len(count)):
        if not live[s]:
            continue
        for t in ring[:, s].tolist():
            if counts[s] >= budget[s]:
                break
            counts[s] += 1
            if t in EOS:
                ended[s] = True
                break
        ended[s] = ended[s] or counts[s] >= budget[s]
    return counts, ended


@pytest.mark.parametrize("steps", [1, 4])
def test_look_equals_the_per_slot_rule(steps: int) -> None:
    """The look (stop checks, lengths and ended slots for all slots at once, on the device) against the
    per-slot rule, on edge cases (an end token at the last step of the group; the budget filled at the
    step of an end token; an end token just past the budget; a slot not running) and random groups."""
    gen = SlotGenerator.create(
        tiny("llama"), EOS, SlotSettings(slots=8, capacity=64, steps_per_sync=steps), fixed_shapes=True
    )
    g = torch.Generator().manual_seed(7)
    stop, go = EOS[0], 10  # an end token, a token that is not one
    cases = []
    if steps == 4:
        cases.append(
            (
                torch.tensor(
                    [
                        [go, go, go, go, stop, go, go, go],
                        [go, go, go, stop, go, go, go, go],
                        [go, go, stop, go, go, stop, go, stop],
                        [stop, stop, go, go, go, go, stop, go],
                    ]
                ),
                [5, 1, 3, 2, 0, 4, 1, 9],  # lengths so far
                [40, 4, 6, 5, 1, 6, 9, 20],  # budgets
                [True, True, True, True, True, True, False, True],
            )
        )
        # slot 0: end token at the last step; 1: budget full at the end token's step; 2: end at step 2 =
        # budget's step; 3: budget full one step before the end token; 4: budget full at the first step;
        # 5: budget full before the end token; 6: not running; 7: end token at step 2
    for _ in range(200):
        ring = torch.where(
            torch.rand(steps, 8, generator=g) < 0.25,
            torch.tensor(EOS)[torch.randint(0, len(EOS), (steps, 8), generator=g)],
            torch.randint(0, 97, (steps, 8), generator=g),
        )
        count = torch.randint(1, 12, (8,), generator=g).tolist()
        budget = [c + int(torch.randint(0, 2 * steps + 1, (), generator=g)) for c in count]
        live = (torch.rand(8, generator=g) < 0.8).tolist()
        live = [a and c < b for a, c, b in zip(live, count, budget, strict=True)]  # running: budget left
        cases.append((ring, count, budget, live))
    for ring, count, budget, live in cases:
        gen.ring.copy_(ring)
        gen.count_d.copy_(torch.tensor(count))
        gen.budget_d.copy_(torch.tensor(budget))
        gen.live_d.copy_(torch.tensor(live))
        gen._look()
        want_count, want_ended = look_reference(ring, count, budget, live)
        assert gen.look[steps].tolist() == want_count, (ring, count, budget, live)
        assert gen.look[steps + 1].bool().tolist() == want_ended, (ring, count, budget, live)
        assert gen.count_d.tolist() == want_count
        assert gen.live_d.tolist() == [a and not e for a, e in zip(live, want_ended, strict=True)]


@pytest.mark.parametrize(("steps", "fixed"), [(4, True), (5, True), (1, False)])
def test_replies_at_every_budget_and_window_boundary(steps: int, fixed: bool) -> None:
    """Budgets 1..13 against groups of 4 and 5 steps (a reply full at the last step of a group, at its
    first, between), many end tokens, fewer slots than requests: a slot ended in one group is refilled
    before the next, while its reply is handed on during the next group; a second round asked from each
    reply. Every reply equals greedy decoding."""
    model = tiny("llama", seed=3)
    requests = [Request(r.key, r.prompt_ids, 1 + i % 13) for i, r in enumerate(random_requests(26, seed=5))]
    settings = SlotSettings(slots=3, capacity=96, prefill_rows=2, max_chunk=16, steps_per_sync=steps)
    source = ListSource(requests, follow_up=True)
    stats = SlotGenerator.create(model, EOS, settings, fixed_shapes=fixed).run(source)
    assert len(source.replies) == 2 * len(requests) == stats.requests
    followups = [
        Request(r.key + "#1", r.prompt_ids + tuple(source.replies[r.key].ids) + (7, 8, 9), r.max_new_tokens)
        for r in requests
    ]
    for r in requests + followups:
        assert source.replies[r.key] == greedy_reference(model, r), r.key
    assert stats.new_tokens == sum(len(x.ids) for x in source.replies.values())
    x = stats.extra  # the split: decode + prefill + host = the run; the source's and the overlapped parts
    assert abs(x["decode_seconds"] + x["prefill_seconds"] + x["host_seconds"] - stats.seconds) < 0.01
    # both parts of the host's time: the source's work, and what ran while steps were in flight (the handing
    # of ended replies: the source's work and its bookkeeping, so neither holds the other)
    assert 0 <= x["host_source_seconds"] <= x["host_seconds"] + 0.002
    assert 0 <= x["host_overlap_seconds"] <= x["host_seconds"] + 0.002


def test_sampled_replies_depend_on_their_seeds_only() -> None:
    """Sampled requests answered with other slot counts, groups of steps and neighbours (a greedy one
    among them) are the same replies; other seeds give other replies."""
    model = tiny("qwen3")
    base = random_requests(14, seed=2)
    sampled = [
        Request(r.key, r.prompt_ids, 16, temperature=1.0 if i % 4 else 0.0, top_p=0.9, seed=1000 + i)
        for i, r in enumerate(base)
    ]
    runs = []
    for slots, steps, fixed in ((2, 1, False), (5, 3, True), (4, 4, True)):
        source = ListSource(sampled if slots != 4 else sampled[::2])
        settings = SlotSettings(slots=slots, capacity=96, prefill_rows=3, max_chunk=16, steps_per_sync=steps)
        SlotGenerator.create(model, EOS, settings, fixed_shapes=fixed).run(source)
        runs.append(source.replies)
    for key, reply in runs[2].items():
        assert runs[0][key] == runs[1][key] == reply, key
    assert runs[0] == runs[1]
    reseeded = ListSource([Request(r.key, r.prompt_ids, 16, 1.0, 0.9, r.seed + 1) for r in sampled])
    SlotGenerator.create(model, EOS, SlotSettings(slots=2, capacity=96)).run(reseeded)
    assert sum(reseeded.replies[r.key] != runs[0][r.key] for r in sampled) >= len(sampled) // 2


@pytest.mark.parametrize(("steps", "fixed"), [(1, False), (3, True)])
def test_samples_of_one_prompt_share_its_prefill(steps: int, fixed: bool) -> None:
    """Several requests with one prompt (the samples of a prompt, greedy and sampled, some with replies of
    one token) among others: only the first of each prompt in a refill is prefilled, the others copy its
    keys and values, and every reply is the one the request gets with nothing shared (greedy: the target's
    greedy decoding)."""
    from dflashkit.data.generator import split_shared

    model = tiny("llama")
    base = random_requests(6, seed=3)
    requests = []
    for i, r in enumerate(base):
        for k in range(3):
            t = 0.0 if (i + k) % 3 == 0 else 1.0
            budget = 1 if (i, k) == (2, 1) else 20
            requests.append(
                Request(f"{r.key}.{k}", r.prompt_ids, budget, temperature=t, top_p=0.9, seed=50 + 7 * i + k)
            )
    unique, copies = split_shared(requests)
    assert len(unique) == 6 and [unique[j].prompt_ids for _, j in copies] == [r.prompt_ids for r, _ in copies]
    replies = {}
    for share in (True, False):
        settings = SlotSettings(
            slots=8, capacity=96, prefill_rows=4, max_chunk=16, steps_per_sync=steps, share_prompts=share
        )
        source = ListSource(requests)
        stats = SlotGenerator.create(model, EOS, settings, fixed_shapes=fixed).run(source)
        replies[share] = source.replies
        assert (stats.extra["shared_prompt_tokens"] > 0) == share
        assert stats.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
    assert replies[True] == replies[False]
    for r in requests:
        if r.temperature == 0:
            assert replies[True][r.key] == greedy_reference(model, r), r.key


def test_errors_are_clear() -> None:
    model = tiny("llama")
    gen = SlotGenerator.create(model, EOS, SlotSettings(slots=2, capacity=32, max_chunk=16))
    with pytest.raises(DflashkitError, match="do not fit a slot"):
        gen.run(ListSource([Request("long", tuple(range(6, 46)), 10)]))
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.raises(DflashkitError, match="model type 'gpt2'.*--backend hf"):
        SlotGenerator.create(gpt2, EOS, SlotSettings())


def test_sampling_follows_the_nucleus() -> None:
    """20,000 draws (one per seed) from a known distribution: the frequencies match softmax(l / T)
    renormalised over the top-p nucleus; tokens outside it are never drawn; temperature 0 is argmax."""
    probs = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02])
    n = 20_000
    logits = (probs.log() * 2).expand(n, -1).clone()  # temperature 2 gives back probs
    seeds = torch.arange(n, dtype=torch.long)
    pos = torch.full((n,), 17, dtype=torch.long)
    drawn = sample(logits, torch.full((n,), 2.0), torch.full((n,), 0.75), seeds, pos)
    nucleus = probs[:4] / probs[:4].sum()  # 0.30 + 0.25 + 0.15 = 0.70 < 0.75: the 4th is kept, then stop
    freq = torch.bincount(drawn, minlength=8).float() / n
    assert freq[4:].sum() == 0
    assert (freq[:4] - nucleus).abs().max() < 0.015, freq
    full = sample(logits, torch.full((n,), 2.0), torch.ones(n), seeds, pos)
    assert (torch.bincount(full, minlength=8).float() / n - probs).abs().max() < 0.015
    greedy = sample(logits, torch.zeros(n), torch.ones(n), seeds, pos)
    assert (greedy == 0).all()
    # Another position or seed draws afresh; the same (seed, position) draws the same token.
    again = sample(logits, torch.full((n,), 2.0), torch.full((n,), 0.75), seeds, pos)
    other = sample(logits, torch.full((n,), 2.0), torch.full((n,), 0.75), seeds, pos + 1)
    assert torch.equal(drawn, again) and (drawn != other).float().mean() > 0.3


def test_sampling_survives_rounding() -> None:
    """Logits that differ by rounding (another batch, another kernel) draw the same tokens: each
    token's noise is its own, so only near-exact ties can flip."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    logits = torch.randn(n, 97, generator=g) * 3
    noisy = logits + torch.randn(n, 97, generator=g) * 1e-6
    args = (torch.full((n,), 1.0), torch.full((n,), 0.95), torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert (sample(logits, *args) != sample(noisy, *args)).sum() <= 2


# --- on a GPU: FlashAttention over the slot cache, CUDA graphs -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flash_attention_equals_the_reference(arch: str) -> None:
    """The variable-length FlashAttention path reads the same positions as the masked reference: rows
    in scattered slots (one a padding row on the scratch slot), a multi-token chunk, then single tokens."""
    model = tiny(arch).to("cuda", torch.bfloat16)
    w = DecoderWeights.from_hf(model)
    caches = {a: SlotCache(w, slots=5, capacity=128) for a in ("sdpa", "flash")}
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (3, 40), generator=g).cuda()
    slots = torch.tensor([4, 1, 5]).cuda()  # 5 is the scratch slot
    out: dict[str, list[torch.Tensor]] = {"sdpa": [], "flash": []}
    with torch.no_grad():
        for a, cache in caches.items():
            zeros = torch.zeros(3, dtype=torch.long, device="cuda")
            last = torch.tensor([31, 17, 0], device="cuda")
            out[a].append(forward(w, cache, ids[:, :32], slots, zeros, last, kv_len=64, attention=a))
            for t in range(32, 40):
                starts = torch.full((3,), t, device="cuda")
                out[a].append(
                    forward(w, cache, ids[:, t : t + 1], slots, starts, zeros, kv_len=64, attention=a)
                )
    for x, y in zip(out["sdpa"], out["flash"], strict=True):
        assert ((x - y).norm() / y.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_generator_equals_greedy(dtype: torch.dtype) -> None:
    """With CUDA graphs (padded rows, chunks and key buckets; flash in bf16): fp32 replies equal greedy
    decoding token for token; bf16 replies equal the same generator run eagerly on most requests (bf16
    rounding parts them after near ties) and a second graph run exactly."""
    model = tiny("llama").to("cuda", dtype)
    requests = random_requests(40)
    settings = SlotSettings(slots=8, capacity=128, prefill_rows=4, max_chunk=32, steps_per_sync=3)
    graphed = SlotGenerator.create(model, EOS, settings)
    assert graphed.graphs.graphs
    first, second = ListSource(requests, follow_up=True), ListSource(requests, follow_up=True)
    graphed.run(first)
    stats = graphed.run(second)
    assert stats.extra["cuda_graphs"] > 0
    assert {k: v.ids for k, v in first.replies.items()} == {k: v.ids for k, v in second.replies.items()}
    if dtype == torch.float32:
        for r in requests:
            assert first.replies[r.key] == greedy_reference(model, r), r.key
    else:
        eager = SlotGenerator.create(model, EOS, SlotSettings(slots=8, capacity=128, cuda_graphs=False))
        reference = ListSource(requests)
        eager.run(reference)
        same = sum(first.replies[r.key] == reference.replies[r.key] for r in requests)
        assert same >= 0.8 * len(requests)


def reference_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, seqused_k):
    """What FlashAttention's variable-length forward computes, in plain torch: sequence i's queries are
    q[cu_q[i]:cu_q[i+1]], its keys k[cu_k[i]:cu_k[i]+seqused_k[i]]; causal alignment is bottom-right."""
    out = torch.zeros_like(q)
    heads, kv_heads = q.shape[1], k.shape[1]
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].float()  # [Lq, H, d]
        ki = k[cu_k[i] : cu_k[i] + seqused_k[i]].float().repeat_interleave(heads // kv_heads, dim=1)
        vi = v[cu_k[i] : cu_k[i] + seqused_k[i]].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        if causal:
            lq, lk = qi.shape[0], ki.shape[0]
            allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[cu_q[i] : cu_q[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi).to(q.dtype)
    return (out,)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flash_path_reads_what_the_reference_reads(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flash path's offsets, used lengths, causal alignment and the packing of a key head's query
    heads in decode steps, checked on the CPU against the masked reference with a plain-torch stand-in
    for the kernel (the GPU test checks the kernel itself)."""
    from dflashkit.target import slot_decoder

    monkeypatch.setattr(slot_decoder, "flash_varlen", reference_flash_varlen)
    model = tiny(arch)
    w = DecoderWeights.from_hf(model)
    caches = {a: SlotCache(w, slots=5, capacity=64) for a in ("sdpa", "flash")}
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(5))
    slots = torch.tensor([4, 1, 5])
    with torch.no_grad():
        for a, cache in caches.items():
            zeros = torch.zeros(3, dtype=torch.long)
            first = forward(
                w, cache, ids[:, :16], slots, zeros, torch.tensor([15, 9, 0]), kv_len=32, attention=a
            )
            steps = [first]
            for t in range(16, 20):
                start = torch.full((3,), t)
                steps.append(
                    forward(w, cache, ids[:, t : t + 1], slots, start, zeros, kv_len=32, attention=a)
                )
            caches[a].out = steps  # type: ignore[attr-defined]
    for x, y in zip(caches["sdpa"].out, caches["flash"].out, strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_prompts_read_what_padded_rows_read(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts packed end to end (`forward_packed`, in scattered slots, one continuing a slot's earlier
    positions) give the logits and the cache rows of the padded rows, on the reference attention and on
    the flash path (the plain-torch stand-in for the kernel; the GPU test checks the kernel)."""
    from dflashkit.target import slot_decoder
    from dflashkit.target.slot_decoder import forward_packed, pack

    monkeypatch.setattr(slot_decoder, "flash_varlen", reference_flash_varlen)
    model = tiny(arch)
    w = DecoderWeights.from_hf(model)
    g = torch.Generator().manual_seed(7)
    lengths, slots = [9, 16, 3], [4, 1, 2]
    ids = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    padded_cache = SlotCache(w, slots=5, capacity=64)
    rows = torch.zeros(3, 16, dtype=torch.long)
    for i, x in enumerate(ids):
        rows[i, : len(x)] = x
    with torch.no_grad():
        zeros = torch.zeros(3, dtype=torch.long)
        last = torch.tensor([n - 1 for n in lengths])
        padded = forward(w, padded_cache, rows, torch.tensor(slots), zeros, last, kv_len=16)
        # then 4 more tokens of the second prompt's slot, at positions 16-19
        more = torch.randint(0, 97, (1, 4), generator=g)
        padded_more = forward(
            w, padded_cache, more, torch.tensor([1]), torch.tensor([16]), torch.tensor([3]), kv_len=32
        )
        for attention in ("sdpa", "flash"):
            cache = SlotCache(w, slots=5, capacity=64)
            packed = forward_packed(
                w, cache, torch.cat(ids), pack(slots, [0, 0, 0], lengths, w.device), attention=attention
            )
            torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-4)
            packed_more = forward_packed(
                w, cache, more[0], pack([1], [16], [4], w.device), attention=attention
            )
            torch.testing.assert_close(packed_more, padded_more, rtol=1e-4, atol=1e-4)
            for mine, theirs in zip(cache.k + cache.v, padded_cache.k + padded_cache.v, strict=True):
                for s, n in zip(slots, lengths, strict=True):
                    torch.testing.assert_close(mine[s, :n], theirs[s, :n], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(mine[1, :20], theirs[1, :20], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash", [False, True])
def test_packed_prefill_gives_the_replies_of_padded_prefill(
    flash: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy and sampled requests (and samples of one prompt sharing its prefill) through packed passes
    give the replies of padded passes, on the reference attention and on the flash path (stand-in)."""
    from dflashkit.target import slot_decoder

    monkeypatch.setattr(slot_decoder, "flash_varlen", reference_flash_varlen)
    model = tiny("llama")
    requests = [
        Request(f"{r.key}.{k}", r.prompt_ids, 16, temperature=(i + k) % 2 * 1.0, top_p=0.9, seed=11 * i + k)
        for i, r in enumerate(random_requests(9, seed=4))
        for k in range(2)
    ]
    replies = {}
    for packed in (False, True):
        settings = SlotSettings(
            slots=6, capacity=96, prefill_rows=4, max_chunk=16, packed_prefill=packed, packed_tokens=64
        )
        gen = SlotGenerator.create(model, EOS, settings)
        if flash and packed:
            gen.attention = "flash"
        source = ListSource(requests)
        stats = gen.run(source)
        assert stats.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
        replies[packed] = source.replies
    assert replies[True] == replies[False]


@pytest.mark.gpu
def test_packed_flash_prefill_equals_the_reference_on_gpu() -> None:
    """FlashAttention's kernel over packed prompts (bf16) reads what the masked reference reads, and the
    generator's packed passes (the default on a GPU in bf16) give the replies of padded passes on most
    requests (bf16 rounding parts some after near ties)."""
    from dflashkit.target.slot_decoder import forward_packed, pack

    model = tiny("qwen3").to("cuda", torch.bfloat16)
    w = DecoderWeights.from_hf(model)
    g = torch.Generator().manual_seed(8)
    lengths, slots = [40, 7, 120], [3, 0, 1]
    tokens = torch.randint(0, 97, (sum(lengths),), generator=g).cuda()
    out = {}
    with torch.no_grad():
        for attention in ("sdpa", "flash"):
            cache = SlotCache(w, slots=4, capacity=256)
            out[attention] = forward_packed(
                w, cache, tokens, pack(slots, [0, 0, 0], lengths, w.device), attention=attention
            )
    assert ((out["sdpa"] - out["flash"]).norm() / out["flash"].norm()) < 2e-2
    requests = random_requests(40)
    replies = {}
    for packed in (True, False):
        settings = SlotSettings(slots=8, capacity=128, prefill_rows=4, max_chunk=32, packed_prefill=packed)
        source = ListSource(requests)
        SlotGenerator.create(model, EOS, settings).run(source)
        replies[packed] = source.replies
    assert sum(replies[True][r.key] == replies[False][r.key] for r in requests) >= 0.8 * len(requests)
