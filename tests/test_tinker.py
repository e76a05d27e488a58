"""The Tinker service (slime.tinker) against the official `tinker` SDK: a real server process
(`python -m slime.tinker`) on loopback, the SDK's ServiceClient and TrainingClient unchanged.

Forward log-probs are Hugging Face's teacher-forced ones; the losses are Tinker's formulas;
forward_backward accumulates gradients until optim_step, with the call's Adam parameters; a
custom loss (forward_backward_custom) trains as the built-in cross_entropy; bad input is named
and leaves other clients alone."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (pip install -e '.[tinker]')")
pytest.importorskip("peft", reason="peft is not installed")

KEY = "tml-slime-test"
TOKENS = [[5, 9, 11, 20, 33, 7], [3, 14, 15, 92, 65]]


def start_server(model: str, store: str, *extra: str, name: str = "tiny") -> tuple[subprocess.Popen, str]:
    """The server on loopback serving `model` as `name`, and its address."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "slime.tinker",
        "--model",
        f"{name}={model}",
        "--port",
        "0",
        "--api-key",
        KEY,
    ]
    cmd += ["--store", store]
    proc = subprocess.Popen(
        [*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the ready line names the address
        lines.append(line)
        if line.startswith("slime.tinker serving"):
            # the rest of its output read on, so the server never blocks on a full pipe
            threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True).start()
            return proc, line.rsplit(" on ", 1)[1].strip()
    raise AssertionError("the server exited before serving:\n" + "".join(lines))


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=60)


@contextlib.contextmanager
def session(url: str):
    """A ServiceClient whose session ends with the block, while its server still runs: the SDK's
    heartbeat thread would otherwise outlive the server and warn for the rest of the test run."""
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        yield service
    finally:
        service.close("success").result()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tinker-store"))


@pytest.fixture(scope="module")
def server(tiny_model, store):
    proc, url = start_server(tiny_model, store, "--check-precision", "1e-4")
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def service(server):
    with session(server) as service:
        yield service


def trainer(service, seed=0):
    return service.create_lora_training_client(base_model="tiny", rank=4, seed=seed, train_unembed=False)


def datum(tokens, **inputs):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def weights(tokens):
    return [0.0] + [1.0] * (len(tokens) - 2)  # the first target is the prompt's


def hf_log_probs(model: str, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def log_probs(result, i=0) -> torch.Tensor:
    return torch.tensor(result.loss_fn_outputs[i]["logprobs"].data)


def test_forward_is_the_teacher_forced_log_probs_and_loss_sum_their_weighted_sum(service, tiny_model):
    tc = trainer(service)
    data = [datum(t, weights=weights(t)) for t in TOKENS]
    result = tc.forward(data, "cross_entropy").result()
    expected = 0.0
    for i, tokens in enumerate(TOKENS):
        reference = hf_log_probs(tiny_model, tokens)
        torch.testing.assert_close(log_probs(result, i), reference, rtol=0, atol=1e-5)
        expected -= float((reference * torch.tensor(weights(tokens))).sum())
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_the_policy_losses_are_tinker_s_formulas(service):
    tc = trainer(service)
    tokens = TOKENS[0]
    n = len(tokens) - 1
    own = log_probs(tc.forward([datum(tokens, weights=[1.0] * n)], "cross_entropy").result())
    g = torch.Generator().manual_seed(0)
    sampled = own + 0.3 * torch.randn(n, generator=g)  # another policy's log-probs
    advantages = torch.randn(n, generator=g)
    inputs = {"logprobs": sampled.tolist(), "advantages": advantages.tolist()}
    ratio = torch.exp(own - sampled)
    clipped = ratio.clamp(0.9, 1.1)
    expected = {
        "importance_sampling": -(ratio * advantages).sum(),
        "ppo": -torch.minimum(ratio * advantages, clipped * advantages).sum(),
        "cispo": -(clipped * own * advantages).sum(),
    }
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    for loss_fn, value in expected.items():
        result = tc.forward(
            [datum(tokens, **inputs)], loss_fn, config if loss_fn != "importance_sampling" else None
        )
        assert result.result().metrics["loss:sum"] == pytest.approx(float(value), rel=1e-5, abs=1e-6), loss_fn
    assert (ratio < 0.9).any() or (ratio > 1.1).any()  # the clip acted


def test_gradients_accumulate_until_optim_step_with_its_own_adam_parameters(service):
    """Two forward_backward calls then a step equal one call with the weights doubled; a step of
    learning rate 0 changes nothing; one of 1e-2 lowers the loss."""
    from tinker import types

    tokens = TOKENS[0]
    one, two, still = (trainer(service, seed=3) for _ in range(3))
    data = [datum(tokens, weights=weights(tokens))]
    twice = [datum(tokens, weights=[2 * w for w in weights(tokens)])]
    before = one.forward(data, "cross_entropy").result().metrics["loss:sum"]
    still.forward_backward(data, "cross_entropy").result()
    assert still.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"] > 0
    assert still.forward(data, "cross_entropy").result().metrics["loss:sum"] == before
    one.forward_backward(data, "cross_entropy").result()
    one.forward_backward(data, "cross_entropy").result()
    two.forward_backward(twice, "cross_entropy").result()
    adam = types.AdamParams(learning_rate=1e-2, beta2=0.99, weight_decay=0.01, grad_clip_norm=1.0)
    norms = [c.optim_step(adam).result().metrics["grad_norm:mean"] for c in (one, two)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    after = [c.forward(data, "cross_entropy").result() for c in (one, two)]
    torch.testing.assert_close(log_probs(after[0]), log_probs(after[1]), rtol=0, atol=1e-6)
    assert after[0].metrics["loss:sum"] < before


def test_a_forward_between_calls_leaves_the_step_and_a_loaded_state_alone(service):
    """The LM head's adapter (train_unembed, the SDK's default) lives in FSDP's root module, which
    a forward without gradients would leave gathered: a forward between forward_backward and
    optim_step must not hide the head's gradients from the step's norm, nor one before load_state
    keep the head's old weights under the loaded ones once a backward pass has run."""
    from tinker import types

    tokens = TOKENS[0]
    data = [datum(tokens, weights=weights(tokens))]
    adam = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    plain, probed = (service.create_lora_training_client(base_model="tiny", rank=4, seed=5) for _ in range(2))
    norms = []
    for client, probe in ((plain, False), (probed, True)):
        client.forward_backward(data, "cross_entropy").result()
        if probe:
            client.forward(data, "cross_entropy").result()
        norms.append(client.optim_step(adam).result().metrics["grad_norm:mean"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)

    path = plain.save_state("before-probe").result().path
    probed.forward_backward(data, "cross_entropy").result()
    probed.optim_step(adam).result()
    probed.forward(data, "cross_entropy").result()
    probed.load_state(path).result()
    probed.forward_backward(data, "cross_entropy").result()  # its backward pass reshards the model
    probed.optim_step(types.AdamParams(learning_rate=0.0)).result()
    torch.testing.assert_close(
        log_probs(probed.forward(data, "cross_entropy").result()),
        log_probs(plain.forward(data, "cross_entropy").result()),
        rtol=0,
        atol=1e-6,
    )


def test_a_custom_loss_trains_as_the_built_in_cross_entropy(service):
    from tinker import types

    tokens = TOKENS[1]
    w = torch.tensor(weights(tokens))
    builtin, custom = trainer(service, seed=5), trainer(service, seed=5)
    data = [datum(tokens, weights=w.tolist())]
    result = builtin.forward_backward(data, "cross_entropy").result()

    def nll(batch, logprobs):
        loss = -(logprobs[0] * w).sum()
        return loss, {"nll": float(loss)}

    mine = custom.forward_backward_custom(data, nll).result()
    assert mine.metrics["loss:sum"] == pytest.approx(result.metrics["loss:sum"], rel=1e-6)
    for c in (builtin, custom):
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [log_probs(c.forward(data, "cross_entropy").result()) for c in (builtin, custom)]
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=1e-6)


def post(url: str, path: str, body: dict, key: str = KEY, retry_of: str | None = None) -> tuple[int, dict]:
    """A raw POST (`retry_of`: its X-Idempotency-Key, as the SDK sends with every try of a call)."""
    headers = {"Content-Type": "application/json", "X-API-Key": key}
    if retry_of is not None:
        headers["X-Idempotency-Key"] = retry_of
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_input_is_named_and_leaves_other_clients_alone(service, server):
    from tinker import types

    tc = trainer(service)
    tokens = TOKENS[0]
    good = [datum(tokens, weights=weights(tokens))]
    before = log_probs(tc.forward(good, "cross_entropy").result())
    with pytest.raises(tinker.BadRequestError, match="base_model 'nope' is not served here; served: tiny"):
        service.create_lora_training_client(base_model="nope", rank=4).get_info()
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'dro' is not built on this server"):
        tc.forward_backward(good, "dro").result()
    with pytest.raises(
        tinker.BadRequestError, match=r"loss_fn_inputs\['weights'\] has shape \[2\]; it needs one"
    ):
        tc.forward([datum(tokens, weights=[1.0, 1.0])], "cross_entropy").result()
    with pytest.raises(
        tinker.BadRequestError, match="needs loss_fn_inputs target_tokens, logprobs, advantages"
    ):
        tc.forward(good, "ppo").result()
    import numpy as np
    from tinker.types.tensor_data import TensorData

    wide = TensorData.from_numpy(np.ones((len(tokens) - 1, 2), dtype=np.float32))
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_inputs\['weights'\] has shape \[5, 2\]"):
        tc.forward([datum(tokens, weights=wide)], "cross_entropy").result()
    nan = TensorData.from_numpy(np.array([1.0, np.nan, 2.0, 3.0, 4.0], dtype=np.float32))
    with pytest.raises(tinker.BadRequestError, match=r"'target_tokens'\] must hold token ids"):
        tc.forward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": nan, "weights": weights(tokens)[: len(tokens) - 1]},
                )
            ],
            "cross_entropy",
        ).result()
    with pytest.raises(
        tinker.RequestFailedError, match=r"target_tokens hold ids outside the vocabulary \[0, 101\)"
    ):
        tc.forward([datum([1, 2, 500], weights=[1.0, 1.0])], "cross_entropy").result()
    model_id = tc.get_info().model_id
    status, answer = post(
        server, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}}
    )
    assert status == 400 and "seq_id 1 is out of order" in answer["detail"]
    status, answer = post(server, "/api/v1/get_info", {"model_id": model_id}, key="tml-wrong")
    assert status == 401 and "invalid API key" in answer["detail"]
    with pytest.raises(tinker.BadRequestError, match="checkpoint name 'a/b': give a non-empty name"):
        tc.save_state("a/b").result()
    assert (
        tc.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics
    )  # (refusals used up their seq_ids)
    torch.testing.assert_close(log_probs(tc.forward(good, "cross_entropy").result()), before, rtol=0, atol=0)


def test_an_expired_session_is_refused_by_name(tiny_model, tmp_path):
    proc, url = start_server(tiny_model, str(tmp_path), "--session-timeout", "0.5")
    try:
        status, created = post(url, "/api/v1/create_session", {"tags": [], "sdk_version": "0.38.0"})
        assert status == 200
        import time

        time.sleep(1.0)  # past the timeout: no heartbeat came
        body = {
            "session_id": created["session_id"],
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 4},
        }
        status, answer = post(url, "/api/v1/create_model", body)
        assert status == 410 and "expired: no heartbeat for 0.5 s" in answer["detail"], answer
    finally:
        stop(proc)


def test_a_saved_state_is_the_trained_adapters_and_loads_with_its_optimizer_after_a_restart(
    service, tiny_model, store
):
    """save_state writes the trained adapters as a PEFT directory (the base plus them computes
    what the server's model computes: only the adapters changed) and the AdamW moments; a client
    from the state with its optimizer steps as the original does, one without does not; the
    store outlives the server."""
    from peft import PeftModel
    from tinker import types
    from transformers import AutoModelForCausalLM

    tokens = TOKENS[0]
    data = [datum(tokens, weights=weights(tokens))]
    adam = types.AdamParams(learning_rate=1e-2)
    tc = trainer(service, seed=7)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    trained = log_probs(tc.forward(data, "cross_entropy").result())
    path = tc.save_state("s1").result().path
    assert path == f"tinker://{tc.get_info().model_id}/weights/s1"
    directory = os.path.join(store, *path[len("tinker://") :].split("/"))
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
        os.path.join(directory, "adapter"),
    ).eval()
    with torch.no_grad():
        logits = peft(torch.tensor([tokens[:-1]])).logits[0].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    torch.testing.assert_close(trained, expected, rtol=0, atol=1e-5)

    resumed = service.create_training_client_from_state_with_optimizer(path)
    fresh = service.create_training_client_from_state(path)
    for c in (resumed, fresh):
        torch.testing.assert_close(
            log_probs(c.forward(data, "cross_entropy").result()), trained, rtol=0, atol=0
        )
    for c in (tc, resumed, fresh):
        c.forward_backward(data, "cross_entropy").result()
        c.optim_step(adam).result()
    after = [log_probs(c.forward(data, "cross_entropy").result()) for c in (tc, resumed, fresh)]
    torch.testing.assert_close(after[1], after[0], rtol=0, atol=1e-6)
    assert (after[2] - after[0]).abs().max() > 1e-4  # fresh AdamW moments step otherwise

    sampler_path = tc.save_weights_for_sampler("s1").result().path
    assert sampler_path.endswith("/sampler_weights/s1")
    with pytest.raises(tinker.BadRequestError, match="holds no optimizer state"):
        service.create_training_client_from_state_with_optimizer(sampler_path).get_info()
    with pytest.raises(tinker.NotFoundError, match="no such checkpoint in this server's store"):
        service.create_training_client_from_state("tinker://nope/weights/x").get_info()

    proc, url = start_server(tiny_model, store)
    try:
        with session(url) as again_service:
            again = again_service.create_training_client_from_state(path)
            torch.testing.assert_close(
                log_probs(again.forward(data, "cross_entropy").result()), trained, rtol=0, atol=0
            )
    finally:
        stop(proc)


def sequence_log_probs(tc, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The training model's log-probs of `tokens` after `prompt` (a forward)."""
    full = prompt + tokens
    result = tc.forward([datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result()
    return log_probs(result)[len(prompt) - 1 :]


def test_sampling_serves_the_base_or_exactly_the_saved_weights(service, tiny_model):
    """A sampler's log-probs of its own samples are the training model's (the base model, or the
    weights saved for it, within 1e-5 in float32); num_samples, seeds, stops by token id, prompt
    log-probs and compute_logprobs as the SDK asks."""
    from tinker import types

    prompt = [5, 9, 11]
    base_model = trainer(service, seed=11)  # B = 0: the base model
    sampler = service.create_sampling_client(base_model="tiny")
    params = types.SamplingParams(max_tokens=6, seed=3)
    first = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, params, include_prompt_logprobs=True
    ).result()
    assert len(first.sequences) == 2 and first.sequences[0].tokens != first.sequences[1].tokens
    for seq in first.sequences:
        assert seq.stop_reason == "length" and len(seq.tokens) == 6
        expected = sequence_log_probs(base_model, prompt, seq.tokens)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, rtol=0, atol=1e-5)
    again = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    tokens = first.sequences[0].tokens
    k = next(i for i in range(1, 6) if tokens[i] not in tokens[:i])
    stopped = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=6, seed=3, stop=[tokens[k]])
    ).result()
    assert stopped.sequences[0].tokens == tokens[: k + 1] and stopped.sequences[0].stop_reason == "stop"
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tiny_model).decode(tokens)
    cut = next(i for i in range(1, len(text)) if text[i] not in text[:i])
    by_string = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=6, seed=3, stop=[text[cut]])
    ).result()
    assert by_string.sequences[0].stop_reason == "stop" and len(by_string.sequences[0].tokens) < 6
    whole = prompt + tokens
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(whole)).result()
    forward = log_probs(base_model.forward([datum(whole, weights=[1.0] * 8)], "cross_entropy").result())
    assert scored[0] is None and first.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(scored[1:]), forward, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(first.prompt_logprobs[1:]), forward[:2], rtol=0, atol=1e-5)

    tc = trainer(service, seed=11)
    tc.forward_backward([datum(whole, weights=[1.0] * 8)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("trained").result().path
    for trained in (
        service.create_sampling_client(model_path=path),
        tc.save_weights_and_get_sampling_client(),
    ):
        seq = trained.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        torch.testing.assert_close(
            torch.tensor(seq.logprobs), sequence_log_probs(tc, prompt, seq.tokens), rtol=0, atol=1e-5
        )
        assert (
            torch.tensor(seq.logprobs) - sequence_log_probs(base_model, prompt, seq.tokens)
        ).abs().max() > 1e-3
        scored = trained.compute_logprobs(types.ModelInput.from_ints(whole)).result()
        trained_forward = log_probs(tc.forward([datum(whole, weights=[1.0] * 8)], "cross_entropy").result())
        torch.testing.assert_close(torch.tensor(scored[1:]), trained_forward, rtol=0, atol=1e-5)


def test_the_rest_listing_shows_runs_and_checkpoints_and_deletes_one(service):
    """The SDK's RestClient (which tinker-cookbook reads): the training runs, a run's checkpoints
    with their tinker paths, a checkpoint's LoRA config, a deletion."""
    tc = trainer(service, seed=13)
    run = tc.get_info().model_id
    state = tc.save_state("r1").result().path
    sampler = tc.save_weights_for_sampler("r1").result().path
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(run).result().checkpoints
    assert {(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed} == {
        ("weights/r1", "training", state),
        ("sampler_weights/r1", "sampler", sampler),
    }
    assert all(c.size_bytes > 0 for c in listed)
    training_run = rest.get_training_run(run).result()
    assert training_run.base_model == "tiny" and training_run.lora_rank == 4
    assert training_run.last_checkpoint.tinker_path == state
    assert run in [r.training_run_id for r in rest.list_training_runs(limit=1000).result().training_runs]
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.lora_rank == 4 and info.train_unembed is False and info.train_mlp is True
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert [c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints] == [state]
    with pytest.raises(tinker.NotFoundError, match="unknown training run 'nope'"):
        rest.get_training_run("nope").result()


def test_check_precision_reports_the_sampler_trainer_gap_and_gates_the_first_step(service):
    """--check-precision: an RL step on the sampler's own samples reports the largest |trainer -
    sampler| log-prob (float32 both: under 1e-5); sampling log-probs that are not the sampler's
    fail a model's first step by name, and the step is not taken."""
    from tinker import types

    prompt = [5, 9, 11]
    seq = (
        service.create_sampling_client(base_model="tiny")
        .sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, seed=1))
        .result()
        .sequences[0]
    )
    full = prompt + seq.tokens
    sampled = [0.0] * (len(prompt) - 1) + list(seq.logprobs)
    advantages = [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens)

    def rl(logprobs):
        return [datum(full, logprobs=logprobs, advantages=advantages)]

    tc = trainer(service, seed=17)
    tc.forward_backward(rl(sampled), "importance_sampling").result()
    metrics = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics
    assert 0 <= metrics["sampler_logprob_abs_diff:max"] < 1e-5
    other = trainer(service, seed=17)
    before = log_probs(
        other.forward([datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result()
    )
    other.forward_backward(rl([q - 0.01 if q else q for q in sampled]), "importance_sampling").result()
    with pytest.raises(
        tinker.RequestFailedError, match=r"--check-precision: before the first step .* by up to 0.01"
    ):
        other.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = log_probs(other.forward([datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result())
    assert torch.equal(after, before)


def test_the_policy_gradients_are_the_weighted_cross_entropy_s(service):
    """importance_sampling's gradient is cross_entropy's with weights r A, cispo's with weights
    sg(clip(r)) A (its ratio detached): one step of each equals one step of that cross_entropy.
    (The log-probs here are not a sampler's: the step-0 gate of --check-precision is passed first.)"""
    from tinker import types

    tokens = TOKENS[1]
    n = len(tokens) - 1
    probe = trainer(service, seed=19)
    own = log_probs(probe.forward([datum(tokens, weights=[1.0] * n)], "cross_entropy").result())
    g = torch.Generator().manual_seed(1)
    sampled, advantages = own + 0.3 * torch.randn(n, generator=g), torch.randn(n, generator=g)
    ratio = torch.exp(own - sampled)
    adam = types.AdamParams(learning_rate=1e-2)
    inputs = {"logprobs": sampled.tolist(), "advantages": advantages.tolist()}
    for loss_fn, weights in (
        ("importance_sampling", ratio * advantages),
        ("cispo", ratio.clamp(0.8, 1.2) * advantages),
    ):
        policy, weighted = trainer(service, seed=19), trainer(service, seed=19)
        for c in (policy, weighted):  # a first step (of nothing) past the --check-precision gate
            c.optim_step(types.AdamParams(learning_rate=0.0)).result()
        policy.forward_backward([datum(tokens, **inputs)], loss_fn).result()
        weighted.forward_backward([datum(tokens, weights=weights.tolist())], "cross_entropy").result()
        after = []
        for c in (policy, weighted):
            c.optim_step(adam).result()
            after.append(log_probs(c.forward([datum(tokens, weights=[1.0] * n)], "cross_entropy").result()))
        torch.testing.assert_close(after[0], after[1], rtol=0, atol=1e-5, msg=loss_fn)


@pytest.mark.parametrize("head", ["own", "tied"])
def test_train_unembed_adapts_the_lm_head_and_its_sampler_serves_it(tiny_model, tmp_path, head):
    """train_unembed (the SDK's default) on a model whose LM head is its own (GLM-4) and on one whose
    head is its embedding (the tiny Qwen3): the head's adapter trains and the sampler of the saved
    weights applies it (its log-probs are the trainer's). On the tied head the adapter acts on the
    head's output alone: the embedding the prompt goes in through is the base model's."""
    from tinker import types

    from tests.conftest import FAMILY_SIZE, make_model

    model = (
        make_model(str(tmp_path / "glm4"), 0, "--arch", "glm4", *FAMILY_SIZE) if head == "own" else tiny_model
    )
    proc, url = start_server(model, str(tmp_path / "store"))
    try:
        with session(url) as service:
            tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
            tokens = TOKENS[0]
            tc.forward_backward([datum(tokens, weights=weights(tokens))], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            prompt = [5, 9, 11]
            sampler = tc.save_weights_and_get_sampling_client()
            seq = sampler.sample(
                types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, seed=2)
            )
            seq = seq.result().sequences[0]
            expected = sequence_log_probs(tc, prompt, seq.tokens)
            torch.testing.assert_close(torch.tensor(seq.logprobs), expected, rtol=0, atol=1e-5)
            path = tc.save_state("head").result().path
            info = service.create_rest_client().get_weights_info_by_tinker_path(path).result()
            assert info.train_unembed is True
            # read while the session lasts: its end clears its temporary files from the store
            adapter = load_adapter(tmp_path / "store", path)
        head_factors = [n for n in adapter if "lm_head" in n]
        assert len(head_factors) == 2 and not any("embed_tokens" in n for n in adapter), sorted(adapter)
        assert any(float(adapter[n].abs().max()) > 0 for n in head_factors if "lora_B" in n)  # it trained
    finally:
        stop(proc)


def load_adapter(store, path: str) -> dict:
    """The PEFT adapter file of a tinker:// checkpoint in the server's store."""
    from safetensors.torch import load_file

    found = list(store.glob(f"**/{path.rsplit('/', 1)[-1]}/adapter/adapter_model.safetensors"))
    assert len(found) == 1, found
    return load_file(str(found[0]))


def run_ranks_client(service, data: list, state: str | None = None) -> dict:
    """forward_backward, a step, then a forward (from `state` when given); what each gave."""
    from tinker import types

    if state is not None:
        tc = service.create_training_client_from_state(state)
        return {"after": [log_probs(tc.forward(data, "cross_entropy").result(), i) for i in range(len(data))]}
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
    first = tc.forward_backward(data, "cross_entropy").result()
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward(data, "cross_entropy").result()
    return {
        "first": [log_probs(first, i) for i in range(len(data))],
        "loss": first.metrics["loss:sum"],
        "grad_norm": step.metrics["grad_norm:mean"],
        "after": [log_probs(after, i) for i in range(len(data))],
        "tc": tc,
    }


@pytest.mark.slow
def test_two_train_ranks_train_as_one(tiny_model, tmp_path):
    """--train-ranks 2: each rank takes every other datum (of three: one rank runs a padding pass
    that counts for nothing), the gradients add up over the ranks. Log-probs, loss, gradient
    norm and the step equal one rank's within 1e-5; a bad datum is refused before any rank
    starts and the ranks go on; a state saved on two ranks loads on one."""
    tokens = [TOKENS[0], TOKENS[1], TOKENS[0][:4]]
    data = [datum(t, weights=weights(t)) for t in tokens]
    proc, url = start_server(tiny_model, str(tmp_path / "one"))
    try:
        with session(url) as service:
            one = run_ranks_client(service, data)
    finally:
        stop(proc)
    proc, url = start_server(tiny_model, str(tmp_path / "two"), "--train-ranks", "2")
    try:
        with session(url) as service:
            two = run_ranks_client(service, data)
            with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
                two["tc"].forward([datum([1, 2, 500], weights=[1.0, 1.0])], "cross_entropy").result()
            again = two["tc"].forward(data, "cross_entropy").result()
            state = two["tc"].save_state("two-ranks").result().path
    finally:
        stop(proc)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for key in ("first", "after"):
        for a, b in zip(one[key], two[key]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not torch.equal(one["first"][0], one["after"][0])  # the step moved the model
    torch.testing.assert_close(log_probs(again, 2), two["after"][2], rtol=0, atol=0)
    proc, url = start_server(tiny_model, str(tmp_path / "two"))  # one rank, the two ranks' store
    try:
        with session(url) as service:
            loaded = run_ranks_client(service, data, state)
    finally:
        stop(proc)
    for a, b in zip(two["after"], loaded["after"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def loaded_adapters(store: str) -> dict:
    """The adapters the server's sampling engine holds (its answer to unloading none)."""
    import glob
    import re

    import requests

    (log,) = glob.glob(os.path.join(store, ".logs", "engine-*.log"))
    with open(log) as f:
        url = re.findall(r"ready at (http://\S+)", f.read())[-1]
    answer = requests.post(url + "/unload_lora_adapter", json={"lora_name": "none-such"}, timeout=30)
    return answer.json()["loaded_adapters"]


@pytest.mark.slow
def test_an_rl_loops_unnamed_samplers_do_not_pile_up(tiny_model, tmp_path):
    """save_weights_and_get_sampling_client once per step, as the cookbook's RL loops call it:
    the store keeps a model's last 8 unnamed weights and the engine its 8 most recently used
    adapters; a superseded sampler is refused by name; the session's end takes the rest."""
    from tinker import types

    store = str(tmp_path / "store")
    proc, url = start_server(tiny_model, store)
    try:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = trainer(service)
        params = types.SamplingParams(max_tokens=2, seed=0)
        prompt = types.ModelInput.from_ints([5, 9, 11])
        samplers = []
        for _ in range(10):
            tc.forward_backward([datum(TOKENS[0], weights=weights(TOKENS[0]))], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            samplers.append(tc.save_weights_and_get_sampling_client())
            samplers[-1].sample(prompt, 1, params).result()
        run = tc.get_info().model_id
        ephemeral = os.path.join(store, run, ".ephemeral")
        assert sorted(os.listdir(ephemeral)) == sorted(f"sampler-{i}" for i in range(2, 10)), os.listdir(
            ephemeral
        )
        assert len(loaded_adapters(store)) == 8
        with pytest.raises(tinker.RequestFailedError, match="superseded by the model's newer ones"):
            samplers[0].sample(prompt, 1, params).result()
        samplers[5].sample(prompt, 1, params).result()  # a kept one, loaded again if it was unloaded
        assert len(loaded_adapters(store)) == 8
        assert service.create_rest_client().list_checkpoints(run).result().checkpoints == []  # none named
        service.close("success").result()
        # another session's training work runs after the ended session's clean-up (one thread)
        with session(url) as other:
            trainer(other).forward([datum(TOKENS[0], weights=weights(TOKENS[0]))], "cross_entropy").result()
        assert not os.path.exists(ephemeral) or os.listdir(ephemeral) == []
    finally:
        stop(proc)


def test_a_retried_request_gets_its_first_answer_and_runs_once(service, server):
    """The SDK retries a call after a network error with the same X-Idempotency-Key: the retry
    gets the first try's answer (its request id, or its refusal), and the work runs once."""
    from tinker import types

    tc = trainer(service)
    model_id = tc.get_info().model_id
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # seq_id 1 (0: create)
    body = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.0}}
    first = post(server, "/api/v1/optim_step", body, retry_of="try-a")
    again = post(server, "/api/v1/optim_step", body, retry_of="try-a")
    assert first[0] == 200 and again == first
    other = post(server, "/api/v1/optim_step", body, retry_of="try-b")  # another call, the same seq_id
    assert other[0] == 400 and "seq_id 2 is out of order" in other[1]["detail"]
    assert post(server, "/api/v1/optim_step", body, retry_of="try-b") == other
    assert post(server, "/api/v1/optim_step", body, key="tml-wrong", retry_of="try-a")[0] == 401
    done = post(server, "/api/v1/retrieve_future", {"request_id": first[1]["request_id"]})
    assert done[0] == 200 and done[1]["type"] == "optim_step"


@pytest.mark.slow
def test_a_killed_server_leaves_no_sampling_engine_behind(tiny_model, tmp_path):
    """SIGKILL gives the server no chance to stop its engines: each engine watches its parent's
    pid (--parent-pid) and shuts itself down."""
    import re
    import select
    import signal

    from tinker import types

    store = str(tmp_path / "store")
    proc, url = start_server(tiny_model, store)
    try:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        sampler = service.create_sampling_client(base_model="tiny")
        sampler.sample(types.ModelInput.from_ints([5, 9]), 1, types.SamplingParams(max_tokens=1)).result()
        with open(os.path.join(store, ".logs", "engine-0.log")) as f:
            pid = int(re.findall(r"engine pid=(\d+)", f.read())[0])
        engine = os.pidfd_open(pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:
        readable, _, _ = select.select([engine], [], [], 120)  # its exit (the bound only guards a hang)
        assert readable, f"the engine {pid} outlived its killed server"
    finally:
        os.close(engine)


@pytest.mark.slow
def test_a_vision_language_base_trains_its_language_model_on_text(tiny_vlm, tmp_path):
    """A Qwen3-VL base: the adapters go on its language model only (the vision tower's attention
    and MLP are named like the language model's), and text data trains."""
    from tinker import types

    from slime.tinker.trainer import LoraSpec, base_config, lora_targets

    modules, _ = lora_targets(base_config(tiny_vlm), LoraSpec(4))
    assert "self_attn.q_proj" in modules and not {"attn.qkv", "attn.proj", "mlp.linear_fc1"} & set(modules)
    proc, url = start_server(tiny_vlm, str(tmp_path / "store"))
    try:
        with session(url) as service:
            tc = service.create_lora_training_client(base_model="tiny", rank=4)
            data = [datum(TOKENS[0], weights=weights(TOKENS[0]))]
            before = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < before
    finally:
        stop(proc)
