"""Engine behaviour on a tiny random-weight Llama: batching, preemption, abort, stops, seeds."""

from __future__ import annotations

import random

import pytest

from gemel import LLM, SamplingParams
from gemel.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
_rng = random.Random(1)
MIXED = [[_rng.randrange(3, 300) for _ in range(n)] for n in (2, 5, 9, 13, 17, 21, 26, 30, 34, 3, 8, 15, 44, 50, 6, 11)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_of_greedy_output(llm):
    alone = [_tokens(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in MIXED]
    together = _tokens(llm.generate(prompt_token_ids=MIXED, sampling_params=GREEDY))
    assert len(MIXED) == 16
    assert together == alone


def test_preemption_keeps_outputs_identical(tiny_llama_dir, llm):
    reference = _tokens(llm.generate(prompt_token_ids=MIXED, sampling_params=GREEDY))
    # 40 blocks of 4 tokens cannot hold 16 sequences of up to 74 tokens: the scheduler must preempt.
    small = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=40)
    outs = small.generate(prompt_token_ids=MIXED, sampling_params=GREEDY)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert _tokens(outs) == reference
    core = small.engine.core
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_preemption_keeps_seeded_samples_identical(tiny_llama_dir, llm):
    """Seeded sampling with each request's own settings through preemption: sequences leave
    the batch and come back in other company, and each samples as it does unpreempted."""
    params = [SamplingParams(temperature=(0.6, 1.0, 1.4)[i % 3], top_k=(0, 8)[i % 2], max_tokens=24, seed=100 + i,
                             ignore_eos=True) for i in range(len(MIXED))]
    reference = _tokens(llm.generate(prompt_token_ids=MIXED, sampling_params=params))
    small = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=40)
    outs = small.generate(prompt_token_ids=MIXED, sampling_params=params)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert _tokens(outs) == reference


def test_chunked_prefill_matches_whole_prefill(tiny_llama_dir, llm):
    reference = _tokens(llm.generate(prompt_token_ids=MIXED[-4:], sampling_params=GREEDY))
    chunked = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512, max_num_batched_tokens=7)
    assert _tokens(chunked.generate(prompt_token_ids=MIXED[-4:], sampling_params=GREEDY)) == reference


def test_abort_frees_every_block(llm):
    engine: LLMEngine = llm.engine
    bm = engine.core.block_manager
    for i, p in enumerate(MIXED[:6]):
        engine.add_request(f"abort-{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    for i in range(6):
        engine.abort(f"abort-{i}")
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_cache_hits_and_same_output(llm):
    prompt = MIXED[13]  # 50 tokens = 12 full blocks of 4
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    second = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    assert second.num_cached_tokens >= 48
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate(prompt_token_ids=[MIXED[0]], sampling_params=SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    first = llm.generate(prompt_token_ids=[MIXED[1]], sampling_params=GREEDY)[0].outputs[0].token_ids
    stop_tok = first[3]
    out = llm.generate(
        prompt_token_ids=[MIXED[1]],
        sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok]),
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == first[: first.index(stop_tok) + 1]


def test_stop_string_truncates_text(llm):
    full = llm.generate(prompt_token_ids=[MIXED[2]], sampling_params=GREEDY)[0].outputs[0].text
    assert len(full) > 6
    stop = full[4:6]
    out = llm.generate(
        prompt_token_ids=[MIXED[2]],
        sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[MIXED[4]], sampling_params=params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompt_token_ids=MIXED[:8], sampling_params=[noise] * 4 + [params] + [noise] * 3)
    assert batch[4].outputs[0].token_ids == alone
    again = llm.generate(prompt_token_ids=[MIXED[4]], sampling_params=params)[0].outputs[0].token_ids
    assert again == alone


def test_sampling_batches_follow_the_batch_as_members_come_and_go(llm, monkeypatch):
    """A step samples with its own sequences' settings while the batch changes under it
    (members joining after others have decoded a while and finishing at different steps, one
    with penalties), though a batch is kept while the same sequences sample: each seeded
    output is the one it gives alone."""
    from gemel.engine.model_runner import ModelRunner

    params = [
        SamplingParams(temperature=0.5, top_k=5, max_tokens=6, seed=1, ignore_eos=True),
        SamplingParams(temperature=1.5, max_tokens=14, seed=2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, max_tokens=9, seed=3, ignore_eos=True, presence_penalty=0.7),
        SamplingParams(temperature=0.9, min_p=0.05, max_tokens=11, seed=4, ignore_eos=True),
    ]
    prompts = MIXED[1:5]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params)]
    built = ModelRunner._sampling_batch
    batches = []

    def recorded(self, seqs):
        batch = built(self, seqs)
        assert batch.temperature.tolist() == pytest.approx([s.params.temperature for s in seqs])
        assert batch.top_p.tolist() == pytest.approx([s.params.top_p for s in seqs])
        batches.append(batch)
        return batch

    monkeypatch.setattr(ModelRunner, "_sampling_batch", recorded)
    engine, tokens = llm.engine, {}
    joins = {0: [1, 3], 4: [0], 7: [2]}  # step -> the requests that arrive before it
    step = 0
    while step <= max(joins) or engine.has_unfinished_requests():
        for i in joins.get(step, []):
            engine.add_request(f"joins-{i}", None, params[i], prompt_token_ids=prompts[i])
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
        step += 1
    assert [tokens[i] for i in range(4)] == alone
    assert len({id(b) for b in batches}) < len(batches)  # kept across steps of the same members


def test_a_kept_sampling_batch_is_for_the_same_sequences_only(llm):
    """The runner keeps a step's sampling batch for the next step of the same sequences in the
    same order, builds a new one for any other company (same size included), after a release,
    and every time where penalties make it depend on the tokens so far."""
    from gemel.engine.sequence import Sequence

    runner = llm.engine.core.runner
    a, b, c = (Sequence(f"kept-{t}", [5, 6, 7], SamplingParams(temperature=t, top_p=p, seed=s))
               for t, p, s in ((0.5, 0.9, 1), (0.8, 1.0, 2), (1.3, 0.7, 3)))
    first = runner._sampling_batch([a, b])
    assert runner._sampling_batch([a, b]) is first
    for company in ([a, c], [b, a], [a], [a, b, c]):
        batch = runner._sampling_batch(company)
        assert batch is not first
        assert batch.temperature.tolist() == pytest.approx([s.params.temperature for s in company])
        assert batch.top_p.tolist() == pytest.approx([s.params.top_p for s in company])
        assert batch.generators == [runner.generators[s.seq_id] for s in company]
    kept = runner._sampling_batch([a, b, c])
    assert runner._sampling_batch([a, b, c]) is kept
    runner.release(b.seq_id)
    assert runner._sampling_batch([a, b, c]) is not kept
    penalised = Sequence("kept-penalised", [5, 6, 7], SamplingParams(temperature=1.0, presence_penalty=0.5))
    assert runner._sampling_batch([a, penalised]) is not runner._sampling_batch([a, penalised])
    for s in (a, b, c, penalised):
        runner.release(s.seq_id)


def test_n_candidates_seeded_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[MIXED[5]], sampling_params=params)[0]
    b = llm.generate(prompt_token_ids=[MIXED[5]], sampling_params=params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_logprobs_are_log_softmax_of_logits(llm):
    import torch

    out = llm.generate(
        prompt_token_ids=[MIXED[3]], sampling_params=SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    ids = MIXED[3] + out.token_ids
    logits = llm.engine.core.prompt_logits(ids)
    ref = torch.log_softmax(logits, dim=-1)
    for step, lp in enumerate(out.logprobs):
        pos = len(MIXED[3]) - 1 + step
        assert lp.token_id == out.token_ids[step]
        assert abs(lp.logprob - float(ref[pos, lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == ref[pos].topk(3).indices.tolist()


def test_chat_messages_and_text_prompts(llm):
    outs = llm.generate(
        ["Hello, world!", [{"role": "user", "content": "How are you?"}]],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    assert outs[0].prompt == "Hello, world!"
    assert outs[1].prompt.startswith("<|im_start|>user\nHow are you?")
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="context"):
        llm.generate(prompt_token_ids=[[5] * 600])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(prompt_token_ids=[[5, 100000]])


def test_n_candidates_share_the_prompt_kv(llm):
    engine = llm.engine
    core = engine.core
    prompt = MIXED[13]  # 50 tokens: 12 full blocks of 4 and a partial one
    before = core.num_forks
    engine.add_request("fork", prompt_token_ids=prompt, params=SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    tables = {}
    while engine.has_unfinished_requests():
        engine.step()
        for sid in ("fork#0", "fork#1", "fork#2"):
            seq = core.seqs.get(sid)
            if seq is not None and seq.num_output_tokens == 1 and sid not in tables:
                tables[sid] = list(seq.block_table)
    assert core.num_forks - before == 2
    shared = len(prompt) // 4  # (50 - 1) // 4 = 12 shared blocks
    assert tables["fork#1"][:12] == tables["fork#0"][:12] == tables["fork#2"][:12]
    assert tables["fork#1"][12] != tables["fork#0"][12]  # the partial block was copied, not shared
    assert shared == 12
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_forked_candidate_equals_unforked_candidate(llm):
    """Candidate 1 of a seeded n=2 request must equal a lone request with seed + 1."""
    prompt = MIXED[12]
    pair = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(n=2, temperature=1.0, seed=40, max_tokens=10, ignore_eos=True))[0]
    lone = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=1.0, seed=41, max_tokens=10, ignore_eos=True))[0]
    assert pair.outputs[1].token_ids == lone.outputs[0].token_ids


def test_outputs_identical_with_prefix_cache_on_and_off(tiny_llama_dir, llm):
    shared = MIXED[13][:40]
    prompts = [shared + p[:5] for p in MIXED[:6]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.engine.core.block_manager.stats.hits > 0
    off_llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512, enable_prefix_caching=False)
    off = [o.outputs[0].token_ids for o in off_llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert off_llm.engine.core.block_manager.stats.hits == 0
    assert on == off


def test_split_by_context_keeps_similar_lengths_together():
    from gemel.engine.model_runner import split_by_context

    assert split_by_context([130, 200, 140, 256]) == [[0, 1, 2, 3]]  # the common case: one group, in order
    assert split_by_context([120, 2000, 130, 150]) == [[0, 2, 3], [1]]  # the long one alone
    assert split_by_context([]) == []
    groups = split_by_context([5, 5000, 40, 900, 12000, 7], slack=16)
    assert sorted(i for g in groups for i in g) == list(range(6))  # a partition
    assert groups == [[0, 5], [2], [3], [1], [4]]


def _generate_recording_steps(llm, prompts):
    """Greedy tokens of ``prompts`` run together, and (scheduled, attention metadata) of each step."""
    runner = llm.engine.core.runner
    steps: list[tuple] = []
    prepare = runner.prepare

    def recording(sched):
        out = prepare(sched)
        steps.append((sched.scheduled, out[2]))
        return out

    runner.prepare = recording
    try:
        return _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)), steps
    finally:
        runner.prepare = prepare


@pytest.mark.parametrize("kernel", [False, True])
def test_decodes_with_very_different_contexts(tiny_llama_dir, kernel):
    """A long-context decode among short ones: on the PyTorch path it gets its own attention
    group (no padding of the short ones to its length); where the C++ kernel attends decodes,
    which reads each context to its own length, all stay one group. Either way everyone's
    tokens equal their solo runs."""
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512, cpu_attention_kernel=kernel)
    if kernel and not llm.engine.core.runner.decode_kernel:
        pytest.skip("the C++ kernels are not available here")
    long_prompt = [_rng.randrange(3, 300) for _ in range(400)]  # the tiny model has 512 positions
    prompts = [long_prompt] + MIXED[:6]
    together, steps = _generate_recording_steps(llm, prompts)
    full_decodes = [len(meta.groups) for scheduled, meta in steps
                    if len(scheduled) == len(prompts) and all(n == 1 for _, n in scheduled)]
    assert full_decodes and all(g == (1 if kernel else 2) for g in full_decodes)
    alone = [_tokens(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("kernel", [False, True])
def test_sequences_behind_a_shared_prefix(tiny_llama_dir, kernel):
    """Prompts sharing a 300-token prefix (cached blocks): without the C++ decode kernel (a GPU,
    or kernels off) they decode with the prefix attended once for the group (cascade); where
    the kernel attends decodes it reads every context in place and nothing is cascaded. Either
    way each one's tokens equal its solo run."""
    from gemel.engine.model_runner import CASCADE_MIN_SHARED_TOKENS

    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512, cpu_attention_kernel=kernel)
    if kernel and not llm.engine.core.runner.decode_kernel:
        pytest.skip("the C++ kernels are not available here")
    prefix = [_rng.randrange(3, 300) for _ in range(300)]
    assert len(prefix) >= CASCADE_MIN_SHARED_TOKENS
    prompts = [prefix + [_rng.randrange(3, 300) for _ in range(n)] for n in (3, 9, 17, 1)]
    alone = [_tokens(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in prompts]
    together, steps = _generate_recording_steps(llm, prompts)
    cascaded = [g.shared_slots.numel() for _, meta in steps for g in meta.groups if g.shared_slots is not None]
    decodes_together = [meta for scheduled, meta in steps
                        if len(scheduled) == len(prompts) and all(n == 1 for _, n in scheduled)]
    assert decodes_together
    if kernel:
        assert not cascaded and all(meta.decode_kernel for meta in decodes_together)
    else:
        assert cascaded and min(cascaded) >= CASCADE_MIN_SHARED_TOKENS
    assert together == alone


def test_step_target_chunks_a_long_prompt_and_records_its_keys(tiny_llama_dir, llm):
    """With decodes running, a long prompt is prefilled in chunks sized by the step-time model,
    and each step tells the model how many keys its prompt chunks attended to. Steps of
    decodes alone, with nothing waiting, take the whole token budget without a fit."""
    from gemel.engine.step_budget import prefill_keys

    timed = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512, itl_target_ms=50.0)
    core = timed.engine.core
    long_prompt = [_rng.randrange(3, 300) for _ in range(300)]
    for i, prompt in enumerate(MIXED[:4]):
        timed.engine.add_request(f"d{i}", prompt_token_ids=prompt, params=GREEDY)
    while not any(s.num_output_tokens for s in core.scheduler.running):
        timed.engine.step()
    timed.engine.add_request("long", prompt_token_ids=long_prompt, params=GREEDY)
    chunks, outputs, budgets = [], {}, []
    fits = []
    fit = core.step_time_model.fit
    core.step_time_model.fit = lambda: fits.append(1) or fit()
    while timed.engine.has_unfinished_requests():
        seq = next((s for s in core.scheduler.running + core.scheduler.waiting if s.seq_id.endswith("long")), None)
        before = seq.num_computed_tokens if seq is not None else None
        fits.clear()
        for out in timed.engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        budgets.append((seq is not None and before < len(long_prompt), core.scheduler.token_budget, bool(fits)))
        if seq is not None and before < len(long_prompt):
            chunk = min(seq.num_computed_tokens, len(long_prompt)) - before
            chunks.append(chunk)
            tokens, keys, _ = core.step_time_model.samples[-1]
            assert keys == prefill_keys(before, chunk)
    assert len(chunks) > 1 and sum(chunks) == len(long_prompt)  # chunked, not taken in one step
    # The first chunk had no fit to go on: the floor.
    assert chunks[0] == core.step_time_model.min_prefill_chunk
    whole = core.config.max_num_batched_tokens
    assert all(budget < whole and fitted for chunking, budget, fitted in budgets if chunking)
    assert budgets[-1] == (False, whole, False)  # the last decodes: nothing waits, nothing fitted
    reference = _tokens(llm.generate(prompt_token_ids=[long_prompt], sampling_params=GREEDY))[0]
    assert outputs["long"] == reference
