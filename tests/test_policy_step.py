"""The train step in-process over a stand-in backend (slime.backends.interface.TrainBackend): a
bigram table on one gloo rank, whose passes record which weights and routing they ran with. What
PolicyTrainer and ValueTrainer decide (passes, swaps, replay, steps, checks) in milliseconds,
without a model or a process of its own."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from slime.backends.interface import Pass, PassResult
from slime.backends.measures import sum_over_ranks
from slime.backends.micro_batch import MicroBatch, make_micro_batch
from slime.backends.policy import PolicyTrainer
from slime.backends.value import ValueTrainer
from slime.backends.weight_copies import swapped
from slime.config.loss import LossConfig
from slime.config.moe import MoEOptions
from slime.config.train import BatchConfig, TrainConfig
from slime.utils.rollout_batch import BatchError, RolloutBatch

VOCAB = 8


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A real gloo group of one rank (the step's reductions are collectives)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Routing:
    """Routing replay's side of a mixture-of-experts model: the engine's routing as tables."""

    def rollout_tables(self, batch, positions):
        return {p: torch.tensor(batch.rollout_routed_experts[p]) for p in positions}


class StandIn:
    """A bigram language model (and value table) as a backend: every pass and step is logged
    with the weights it ran with (a fingerprint) and the routing it was asked to replay."""

    experts = True
    """Whether the model has routers when a routing replay flag asks for them."""

    def __init__(self, cfg: TrainConfig, rank=None, world_size=None, init_method=None):
        from transformers import Qwen3Config

        self.cfg = cfg
        self.hf_config = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
        )
        self.device = torch.device("cpu")
        self.rank, self.world_size, self.dp_rank, self.dp_size = 0, 1, 0, 1
        self.dp_group, self.context_parallel, self.writes_train_data = None, 1, True
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g))
        self.value = torch.nn.Parameter(torch.randn(VOCAB, generator=g))
        self.optimizer = torch.optim.SGD([self.table, self.value], lr=0.5)
        moe = cfg.moe.use_routing_replay or cfg.moe.use_rollout_routing_replay
        self.routing = Routing() if moe and self.experts else None
        self.ref_state = self.snapshot() if cfg.loss.needs_ref else None
        self.teacher_state = None
        self.log: list[tuple] = []

    def weights(self) -> int:
        """A fingerprint of the table (its sum would not do: a softmax row's gradient sums to 0)."""
        return hash(self.table.detach().numpy().tobytes())

    def init(self):
        return {}

    def _mb(self, batch: RolloutBatch, positions: list[int]) -> MicroBatch:
        return make_micro_batch(
            positions, batch.tokens, batch.response_lengths, batch.loss_masks, self.device
        )

    def _forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols, targets = mb.predictions()
        log_probs = torch.log_softmax(self.table[mb.input_ids[rows, cols]] / self.cfg.rollout_temperature, -1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return mb.scatter(log_probs.gather(-1, targets[:, None])[:, 0]), mb.scatter(entropy)

    @torch.no_grad()
    def log_prob_pass(self, batch, plans, how: Pass) -> PassResult:
        self.log.append(("pass", self.weights(), how.replay, how.entropy, how.record))
        result = PassResult({}, {} if how.entropy else None, {} if how.record else None)
        for step in plans:
            for positions in step.micro_batches:
                mb = self._mb(batch, positions)
                log_probs, entropy = self._forward(mb)
                for row, p in enumerate(mb.positions):
                    result.log_probs[p] = log_probs[row, : mb.response_lengths[row]].clone()
                    if result.entropy is not None:
                        result.entropy[p] = entropy[row, : mb.response_lengths[row]].clone()
                    if result.routing is not None:
                        result.routing[p] = torch.full((len(batch.tokens[p]), 1, 2), p)
        return result

    def _step(self, sums) -> dict[str, float]:
        self.optimizer.step()
        return {**sum_over_ranks(sums), "grad_norm": 0.0, "lr": 0.5}

    def train_step(self, batch, step, loss, replay):
        self.log.append(("step", self.weights(), replay))
        self.optimizer.zero_grad()
        sums = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        for positions in step.micro_batches:
            mb = self._mb(batch, positions)
            log_probs, entropy = self._forward(mb)
            loss(mb, log_probs, entropy, sums).backward()
        return self._step(sums)

    def value_pass(self, batch, plans):
        out = {}
        for step in plans:
            for positions in step.micro_batches:
                mb = self._mb(batch, positions)
                values = self._values(mb).detach()
                for row, p in enumerate(mb.positions):
                    out[p] = values[row, : mb.response_lengths[row]].clone()
        return out

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        rows, cols, _ = mb.predictions()
        return mb.scatter(self.value[mb.input_ids[rows, cols]])

    def value_step(self, batch, step, loss):
        self.optimizer.zero_grad()
        sums = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        for positions in step.micro_batches:
            mb = self._mb(batch, positions)
            loss(mb, self._values(mb), sums).backward()
        return self._step(sums)

    def snapshot(self):
        return {"table": self.table.detach().clone(), "value": self.value.detach().clone()}

    def copy_in(self, state):
        with torch.no_grad():
            self.table.copy_(state["table"])
            self.value.copy_(state["value"])

    def reference_weights(self):
        assert self.ref_state is not None
        return swapped(self, self.ref_state)


class Dense(StandIn):
    experts = False


class Policy(PolicyTrainer[StandIn]):
    backend_class = StandIn


class DensePolicy(PolicyTrainer[StandIn]):
    backend_class = Dense


class Critic(ValueTrainer[StandIn]):
    backend_class = StandIn


def rollout(n: int = 8, versions: str | None = None) -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (4 + k % 3,), generator=g).tolist() for k in range(n)]
    responses = [2 + k % 2 for k in range(n)]
    return RolloutBatch(
        tokens=tokens,
        response_lengths=responses,
        rewards=[float(k % 2) for k in range(n)],
        group_indices=[k // 4 for k in range(n)],
        rollout_routed_experts=[[[[p, p]]] * (len(t) - 1) for p, t in enumerate(tokens)],
        weight_versions=None if versions is None else [versions] * n,
    )


def trainer(moe: dict | None = None, dense: bool = False, precision: bool = False, **loss):
    """A policy over a stand-in (a mixture of experts when `moe` flags are given, unless `dense`)."""
    cfg = TrainConfig(
        hf_checkpoint="stand-in",
        batch=BatchConfig(global_batch_size=4, micro_batch_size=2),
        loss=LossConfig(**loss),
        moe=MoEOptions(**(moe or {})),
        check_precision=precision,
    )
    policy = (DensePolicy if dense else Policy)(cfg)
    return policy, policy.backend


def test_one_log_prob_pass_then_every_planned_step_and_the_first_step_is_on_policy():
    policy, backend = trainer()
    start = backend.weights()
    out = policy.train(0, rollout())
    assert [e[0] for e in backend.log] == ["pass", "step", "step"]  # 8 samples, 4 per step
    assert backend.log[0][1] == backend.log[1][1] == start  # the pass and step 0 on the same weights
    assert backend.log[2][1] != start  # step 1 after step 0's update
    assert out.steps[0]["ppo_kl"] == 0.0 and out.steps[1]["ppo_kl"] != 0.0
    assert out.rollout["log_probs"] < 0 and set(out.perf) and out.timings["train"] >= 0


def test_the_reference_pass_runs_on_the_reference_weights_and_the_policy_comes_back():
    policy, backend = trainer(use_kl_loss=True, kl_loss_coef=0.1)
    start = backend.weights()
    first = policy.train(0, rollout())
    trained = backend.weights()
    assert first.rollout["kl"] == 0.0  # the reference is the start
    second = policy.train(1, rollout())
    passes = [e[1] for e in backend.log if e[0] == "pass"]
    assert passes == [start, start, trained, start]  # old, ref, old, ref
    assert second.rollout["kl"] != 0.0 and backend.log[-2][1] == trained


def test_ref_update_interval_makes_the_trained_weights_the_reference():
    policy, backend = trainer(use_kl_loss=True, ref_update_interval=1)
    policy.train(0, rollout())
    trained = backend.weights()
    policy.train(1, rollout())
    assert [e[1] for e in backend.log if e[0] == "pass"][-1] == trained


def test_keep_old_actor_takes_the_old_log_probs_with_the_weights_that_generated_the_rollout():
    policy, backend = trainer(keep_old_actor=True)
    policy.keep_weights("v0")
    v0 = backend.weights()
    policy.train(0, rollout(versions="v0"))
    assert backend.weights() != v0
    policy.train(1, rollout(versions="v0"))  # one step off: generated before the last update
    assert [e[1] for e in backend.log if e[0] == "pass"] == [v0, v0]
    with pytest.raises(BatchError, match=r"version\(s\) \['v7'\], the versions kept are \['v0'\]"):
        policy.train(2, rollout(versions="v7"))
    for k in range(5):  # the newest three stay
        policy.keep_weights(f"v{k + 1}")
    assert list(policy.kept.versions) == ["v3", "v4", "v5"]


def test_r2_replays_in_every_later_pass_the_routing_the_old_pass_recorded():
    policy, backend = trainer(moe={"use_routing_replay": True}, use_kl_loss=True)
    policy.train(0, rollout())
    old, ref, *steps = backend.log
    assert old[2] is None and old[4] is True  # recorded, nothing replayed
    assert ref[2] is not None and sorted(ref[2]) == list(range(8)) and ref[4] is False
    assert all(s[2] is ref[2] for s in steps) and len(steps) == 2
    assert torch.equal(ref[2][3], torch.full((len(rollout().tokens[3]), 1, 2), 3))


def test_r3_replays_the_engine_routing_in_every_pass_and_step():
    policy, backend = trainer(moe={"use_rollout_routing_replay": True}, use_kl_loss=True)
    policy.train(0, rollout())
    replays = [e[2] for e in backend.log]
    assert len(replays) == 4 and all(
        r is not None and torch.equal(r[5], torch.tensor([[[5, 5]]] * 5)) for r in replays
    )
    dense, _ = trainer(moe={"use_rollout_routing_replay": True}, dense=True)
    with pytest.raises(Exception, match="needs a mixture-of-experts model"):
        dense.train(0, rollout())


def test_rollout_entropy_comes_from_the_log_prob_passes():
    policy, backend = trainer(use_rollout_entropy=True, use_kl_loss=True)
    out = policy.train(0, rollout())
    assert [e[3] for e in backend.log if e[0] == "pass"] == [True, True]
    assert out.rollout["entropy"] == out.rollout["ref_entropy"] > 0


def test_check_precision_reports_the_first_step_gap():
    policy, _ = trainer(precision=True)
    out = policy.train(0, rollout())
    assert out.precision["first_step_max_abs_diff"] == 0.0 and out.precision["nonfinite"] == 0.0


def test_ppo_needs_values_for_every_response_token_and_returns_the_critics_targets():
    policy, _ = trainer(advantage_estimator="ppo")
    batch = rollout()
    with pytest.raises(BatchError, match="ppo trains with the critic's values"):
        policy.train(0, batch)
    values = {k: [0.0] * r for k, r in enumerate(batch.response_lengths)}
    short = {**values, 3: [0.0]}
    with pytest.raises(
        BatchError, match=r"sample 3: the critic's values do not cover its 3 response tokens \(1 given\)"
    ):
        policy.train(0, batch, values=short)
    out = policy.train(0, batch, values=values)
    assert out.returns is not None and sorted(out.returns) == list(range(8))
    assert out.returns[1] == [1.0] * 3  # reward 1, values 0, gamma = lambda = 1


def test_without_update_no_step_is_taken():
    policy, backend = trainer(advantage_estimator="ppo")
    batch = rollout()
    values = {k: [0.0] * r for k, r in enumerate(batch.response_lengths)}
    start = backend.weights()
    out = policy.train(0, batch, values=values, update=False)
    assert out.steps == [] and backend.weights() == start and [e[0] for e in backend.log] == ["pass"]


def test_the_critic_steps_on_the_returns_and_its_first_step_matches_its_value_pass():
    cfg = TrainConfig(hf_checkpoint="stand-in", batch=BatchConfig(global_batch_size=4), check_precision=True)
    critic = Critic(cfg)
    batch = rollout()
    values = critic.compute_values(batch)
    assert sorted(values) == list(range(8)) and all(
        len(values[k]) == r for k, r in enumerate(batch.response_lengths)
    )
    returns = {k: [1.0] * len(v) for k, v in values.items()}
    out = critic.train_values(0, batch, values, returns)
    assert len(out.steps) == 2 and out.steps[0]["value_loss"] > 0
    assert out.precision["critic_first_step_max_abs_diff"] == 0.0
    assert out.rollout["returns"] == 1.0
    after = critic.compute_values(batch)
    assert sum(abs(1 - x) for v in after.values() for x in v) < sum(
        abs(1 - x) for v in values.values() for x in v
    )
    with pytest.raises(BatchError, match="sample 0: none returns for its 2 response tokens"):
        critic.train_values(1, batch, values, {k: v for k, v in returns.items() if k})


def test_the_trainer_reaches_the_model_only_through_the_backend_protocol():
    """PolicyTrainer and ValueTrainer name no backend and no Ray (the step is the backends' common part)."""
    import ast
    import pathlib

    import slime.backends as pkg

    root = pathlib.Path(pkg.__file__).parent
    for name in ("trainer.py", "policy.py", "value.py", "planning.py", "measures.py", "weight_copies.py"):
        tree = ast.parse((root / name).read_text())
        imported = {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert not {
            m
            for m in imported
            if m.startswith(("slime.backends.fsdp", "slime.backends.megatron", "ray", "slime.ray"))
        }, name
