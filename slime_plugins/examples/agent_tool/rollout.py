"""The agent of agent.py trained through the OpenAI adapter: slime's generate signature.

    --custom-generate-function-path slime_plugins.examples.agent_tool.rollout.generate

Per sample: a session is opened on the adapter (one adapter per rollout process, served from a
thread of its own, its turns sent to the engine this sample was given), the agent runs with the
session id as its API key and its python tool in a LocalSandbox (no network, 512 MB, 10 s), the
reward is 1 when its final answer is the label, and the session's trajectory becomes the samples
trained on: exactly the engine's tokens, the tool's output masked. A run that fails (the agent
crashes or overruns AGENT_TIMEOUT_S) is dropped from the loss (`remove_sample`, reward 0), as
slime's coding-agent example does, and nothing half-recorded is kept.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import uuid
from typing import Any

import openai

from slime.agent.adapters import OpenAIAdapter
from slime.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread
from slime.agent.local_sandbox import LocalSandbox
from slime.utils.misc import SingletonMeta
from slime.utils.sample import Sample
from slime_plugins.examples.agent_tool.agent import solve

logger = logging.getLogger(__name__)
for _name in ("httpx", "httpx2"):  # the OpenAI client's HTTP library logs every request at INFO
    logging.getLogger(_name).setLevel(logging.WARNING)

AGENT_TIMEOUT_S = 120.0
TOOL_TIMEOUT_S = 10


class AdapterService(metaclass=SingletonMeta):
    """The process's adapter and its server."""

    def __init__(self, args: Any) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.adapter = OpenAIAdapter(
            tokenizer=self.tokenizer,
            sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
            tool_parser=getattr(args, "sglang_tool_call_parser", None) or "hermes",
        )
        # Errors and slow requests only in the access log (an agent run makes many requests).
        self.handle = run_app_in_thread(
            self.adapter.app,
            thread_name="agent-adapter",
            runner_kwargs={"access_log_class": FilteredAccessLogger},
        )
        self.url = self.handle.url


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample | list[Sample]:
    service = AdapterService(args)
    sid = f"agent-{sample.group_index}-{sample.index}-{uuid.uuid4().hex[:8]}"
    engine = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    service.adapter.open_session(sid, sampling_defaults=sampling_params, engine_url=engine, trace=sample)
    question = sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt[-1]["content"])
    try:
        async with LocalSandbox(memory_mb=512, max_output_bytes=4096) as sandbox:

            async def run_code(code: str) -> str:
                await sandbox.write_file("tool.py", code)
                status, out, err = await sandbox.exec(
                    f"python3 {shlex.quote('tool.py')}", timeout=TOOL_TIMEOUT_S
                )
                return (out if status == 0 else err).strip()[-200:]

            async with openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key=sid, max_retries=2) as client:
                answer = await asyncio.wait_for(solve(client, question, run_code), AGENT_TIMEOUT_S)
        reward = float(answer.strip() == str(sample.label).strip())
        samples = await service.adapter.finish_session(
            sid, base_sample=sample, reward=reward, extra_metadata={"agent_answer": answer}
        )
    except asyncio.CancelledError:  # the rollout is cancelling this group: nothing of the session stays
        service.adapter.discard_session(sid)
        raise
    except Exception as e:  # the agent crashed or overran: nothing of it is trained on
        logger.warning("agent session %s failed: %s: %s", sid, type(e).__name__, e)
        await service.adapter.drop_session(sid)
        return _failed(sample, service.tokenizer, f"{type(e).__name__}: {e}")
    if not samples:
        return _failed(sample, service.tokenizer, "the session recorded no turn")
    return samples[0] if len(samples) == 1 else samples


def _failed(sample: Sample, tokenizer: Any, reason: str) -> Sample:
    sample.tokens = [*sample.tokens, tokenizer.eos_token_id]
    sample.response, sample.response_length = "", 1
    sample.loss_mask, sample.rollout_log_probs = [0], [0.0]
    sample.reward, sample.remove_sample = 0.0, True
    sample.status = Sample.Status.FAILED
    sample.metadata = {**sample.metadata, "agent_failure": reason}
    return sample
