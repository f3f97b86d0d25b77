"""End to end: real SGLang servers (``python -m sglang.launch_server``) with ``--attention-backend tpa`` and with
SGLang's own ``torch_native`` backend, on a tiny random model this test writes, must give the same greedy tokens.

The servers run on SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``), listen on 127.0.0.1 only, are stopped by PID
and bounded in time. Without Triton's interpreter the ``tpa`` ops serve CPU tensors through their PyTorch reference;
one configuration also runs with ``TRITON_INTERPRET=1``, so that the real kernels serve a server.

Skipped unless sglang and the modules its server imports are installed (``.ci/sglang-setup`` installs them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("sglang")
_SERVER_MODULES = ("uvloop", "setproctitle", "xxhash", "zstandard", "prometheus_client", "multipart", "xgrammar")
_missing = [m for m in _SERVER_MODULES if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"an SGLang server needs {', '.join(_missing)} (see .ci/sglang-setup)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300
_START_ATTEMPTS = 3  # a server whose port was taken before it listened starts again on another
NEW_TOKENS = 12
CHUNK = 64  # --chunked-prefill-size: prompts longer than this are prefilled in chunks

# Small enough for two CPU cores, large enough that attention decides the tokens: random weights with a wide
# initialisation make the attention scores far from uniform (a wrong attention changes the greedy tokens).
_COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=32, vocab_size=2000, max_position_embeddings=2048,
               initializer_range=0.08)  # fmt: skip


def _config(kind: str, **changes):
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**_COMMON, **changes)
    # Gemma-2-like: every other layer a sliding window (shorter than the prompts), tanh soft cap on the scores.
    # (SGLang reads hidden_act; transformers names it hidden_activation.)
    gemma = dict(sliding_window=24, attn_logit_softcapping=5.0, final_logit_softcapping=30.0, query_pre_attn_scalar=4,
                 hidden_act="gelu_pytorch_tanh")  # fmt: skip
    return transformers.Gemma2Config(**_COMMON, **{**gemma, **changes})


def _hf_model(kind: str, **changes):
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(_config(kind, **changes)).eval()
    model = transformers.Gemma2ForCausalLM(_config(kind, **changes)).eval()
    with torch.no_grad():
        # Gemma normalises each attention output; scaled up (x10) it outweighs the token's own (tied, scaled)
        # embedding in the residual stream, so that the tokens depend on what attention reads.
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.fill_(9.0)
    return model


@functools.cache
def _model(kind: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=f"tpa-e2e-{kind}-"))
    _hf_model(kind).save_pretrained(path)
    return path


class Transformers:
    """Hugging Face's own implementation of the model (eager attention, with its window and soft cap) behind the
    servers' ``generate``: the reference where SGLang's torch_native backend lacks a feature (it has no soft cap)."""

    def __init__(self, kind: str, **changes):
        self.model = _hf_model(kind, **changes)
        self.model.config._attn_implementation = "eager"

    def generate(self, input_ids: list[int], new_tokens: int = NEW_TOKENS) -> dict:
        import torch

        with torch.no_grad():
            out = self.model.generate(torch.tensor([input_ids]), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False)  # fmt: skip
        return {"output_ids": out[0, len(input_ids) :].tolist(), "meta_info": {"cached_tokens": None}}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One server configuration, served by each backend."""

    model: str
    flags: tuple[str, ...]
    page_size: int = 1
    scenarios: tuple[str, ...] = ("plain", "prefix", "long", "concurrent")
    reference: str = "torch_native"  # the server backend, or "transformers" (see Transformers)


SETUPS = {
    "page1-mixed-chunk": Setup("llama", ("--enable-mixed-chunk",)),
    "page16": Setup("llama", (), page_size=16),
    # One pool for all layers: the backend reads req_to_token, which a hybrid sliding-window pool does not address.
    "gemma2-window-softcap": Setup(
        "gemma2", ("--disable-hybrid-swa-memory",), scenarios=("plain", "prefix", "long"), reference="transformers"
    ),  # fmt: skip
}
# The real kernels under the interpreter (~1 s per model step on two cores): a short subset.
INTERPRETED = ("page16", ("plain", "prefix", "long"))


def _free_port() -> int:
    """A free port under the kernel's ephemeral range and outside the one SGLang draws its own ports from
    (22000-29999): a port from ``bind(0)`` can be handed again as the source port of any outgoing connection (the
    server's own start-up connects to its process-group store) before the server listens on it."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = range(12000, min(22000, ephemeral_low))
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (a machine whose ephemeral range starts low: the retry in Server covers it)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, setup: Setup, backend: str, interpret: bool, log: Path):
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        if importlib.util.find_spec("sgl_kernel") is None:
            # SGLang's CPU path imports names from its CUDA kernel package at module level and calls none of them.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / ".ci" / "gpu-stubs"), env.get("PYTHONPATH")]))
        for attempt in range(_START_ATTEMPTS):
            self.port = _free_port()
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(_model(setup.model)),
                   "--skip-tokenizer-init", "--device", "cpu", "--dtype", "float32", "--disable-cuda-graph",
                   "--max-total-tokens", "4096", "--chunked-prefill-size", str(CHUNK),
                   "--page-size", str(setup.page_size), "--attention-backend", backend,
                   "--host", "127.0.0.1", "--port", str(self.port), *setup.flags]  # fmt: skip
            self._out = open(log, "w")  # noqa: SIM115  (the server's output until stop())
            self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
            try:
                if self._wait_ready(last=attempt == _START_ATTEMPTS - 1):
                    return
            except BaseException:
                self.stop()
                raise
            self.stop()  # the port was taken between the choice and the bind: again on another one

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_ready(self, last: bool) -> bool:
        """True once the server answers; False where it could not listen on its port (and ``last`` is false)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.text()
            if "The server is fired up" in text:
                return True
            if not last and "address already in use" in text:
                return False
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} at start-up:\n{self.text()[-6000:]}")
            time.sleep(0.5)
        pytest.fail(f"server not ready after {START_TIMEOUT_S} s:\n{self.text()[-6000:]}")

    def generate(self, input_ids: list[int], new_tokens: int = NEW_TOKENS) -> dict:
        body = {"input_ids": input_ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return json.load(response)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # SGLang's launcher drains and stops its children
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):  # whatever is left of its process group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._out.close()


def _prompt(seed: int, n: int) -> list[int]:
    # Token ids from a fixed generator; 0-2 (pad, eos, bos) avoided.
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, _COMMON["vocab_size"]) for _ in range(n)]


PREFIX = _prompt(1, 150)


def _run(server: Server, scenario: str) -> dict:
    """The scenario's requests: ``{name: (output_ids, cached_tokens)}``."""
    done = {}

    def ask(name, ids, new_tokens=NEW_TOKENS):
        reply = server.generate(ids, new_tokens)
        done[name] = (reply["output_ids"], reply["meta_info"]["cached_tokens"])

    if scenario == "plain":
        ask("plain", _prompt(2, 40))
        ask("first_token_changed", [7] + _prompt(2, 40)[1:])
    elif scenario == "prefix":
        # The second request shares a long prefix with the first: served from the radix cache.
        ask("first", PREFIX + _prompt(3, 5))
        ask("second", PREFIX + _prompt(4, 7))
    elif scenario == "long":
        ask("long", _prompt(5, 3 * CHUNK + 20))
    elif scenario == "concurrent":
        # Short requests still decoding while a long prompt's chunks are prefilled (mixed batches where enabled).
        threads = [threading.Thread(target=ask, args=(f"short{i}", _prompt(10 + i, 9 + 5 * i), 200)) for i in range(4)]
        threads.append(threading.Thread(target=ask, args=("long", _prompt(20, 3 * CHUNK + 5))))
        for i, t in enumerate(threads):
            t.start()
            time.sleep(0.3 if i == 3 else 0.02)
        for t in threads:
            t.join(REQUEST_TIMEOUT_S)
        assert len(done) == len(threads), f"requests unanswered: {len(threads) - len(done)}"
    return done


@functools.cache
def _served(name: str, backend: str, interpret: bool = False) -> tuple[dict, str]:
    """Every scenario of a setup on one server (started once per session): results and the server's log."""
    import tempfile

    setup = SETUPS[name]
    scenarios = INTERPRETED[1] if interpret else setup.scenarios
    if backend == "transformers":
        model = Transformers(setup.model)
        return {s: _run(model, s) for s in scenarios}, ""
    log = Path(tempfile.mkdtemp(prefix="tpa-e2e-log-")) / f"{name}-{backend}{'-interpret' if interpret else ''}.log"
    server = Server(setup, backend, interpret, log)
    try:
        return {s: _run(server, s) for s in scenarios}, server.text()
    finally:
        server.stop()


CASES = [(name, s) for name, setup in SETUPS.items() for s in setup.scenarios]


@pytest.mark.parametrize(("setup", "scenario"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_same_greedy_tokens_as_the_reference(setup, scenario):
    """tpa's server gives token for token what SGLang's torch_native backend gives (or Hugging Face's model)."""
    expected = _served(setup, SETUPS[setup].reference)[0][scenario]
    actual, log = _served(setup, "tpa")
    view = "page" if SETUPS[setup].page_size > 1 else "token"
    assert (
        f"tpa backend: {view} view of the KV pool (page size {SETUPS[setup].page_size}), served by the PyTorch" in log
    )
    actual = actual[scenario]
    assert {k: v[0] for k, v in actual.items()} == {k: v[0] for k, v in expected.items()}
    if scenario == "prefix":
        # The radix cache served the shared prefix, whole pages of it.
        page = SETUPS[setup].page_size
        assert actual["second"][1] >= len(PREFIX) // page * page


def test_mixed_chunks_formed():
    """With --enable-mixed-chunk a long prompt's chunks ran in one batch with the decodes of running requests: SGLang
    then shrinks the chunk by one token per decode it carries (a chunk of 64 - 4 beside 4 decodes)."""
    log = _served("page1-mixed-chunk", "tpa")[1]
    batches = [(int(n), int(r)) for n, r in re.findall(r"Prefill batch.*?#new-token: (\d+).*?#running-req: (\d+)", log)]
    assert any(r > 0 and n == CHUNK - r for n, r in batches), batches


@pytest.mark.parametrize("scenario", INTERPRETED[1])
def test_real_kernels_serve_the_same_tokens(scenario):
    """``TRITON_INTERPRET=1``: the Triton kernels themselves (not the reference) behind a server."""
    expected = _served(INTERPRETED[0], "torch_native")[0][scenario]
    actual, log = _served(INTERPRETED[0], "tpa", interpret=True)
    assert "served by the Triton kernels under Triton's interpreter" in log
    assert {k: v[0] for k, v in actual[scenario].items()} == {k: v[0] for k, v in expected.items()}


def test_attention_decides_the_tokens():
    """The comparison means something: the tokens depend on what attention reads far back (a prompt differing only
    in its first token continues differently)."""
    plain = _served("page1-mixed-chunk", "torch_native")[0]["plain"]
    assert plain["plain"][0] != plain["first_token_changed"][0]


@pytest.mark.parametrize("change", [{"attn_logit_softcapping": None}, {"sliding_window": 4096}], ids=str)
def test_window_and_soft_cap_change_the_gemma_tokens(change):
    """The Gemma-like comparison checks the window and the soft cap: without either, other tokens come."""
    model = Transformers("gemma2", **change)
    results = {s: _run(model, s) for s in SETUPS["gemma2-window-softcap"].scenarios}
    expected = _served("gemma2-window-softcap", "transformers")[0]
    assert any(results[s][k][0] != v[0] for s in results for k, v in expected[s].items())


def test_a_server_whose_port_is_taken_starts_on_another(monkeypatch, tmp_path):
    """The start-up retry: the first port chosen is held by a listening socket (as when another process took it
    between the choice and the server's bind); the server starts again on the next one and answers there."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        free_port = _free_port
        monkeypatch.setattr(sys.modules[__name__], "_free_port", lambda: next(ports, None) or free_port())
        server = Server(SETUPS["page16"], "torch_native", False, tmp_path / "server.log")
        try:
            assert server.port != taken
            assert len(server.generate(_prompt(2, 20), 2)["output_ids"]) == 2
        finally:
            server.stop()
