"""Shared test helpers: a tiny model on disk, prompt files and simple reward functions."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm

ALPHABET = "0123456789+=abc "


def make_model_dir(path: Path, architecture: str = "llama", seed: int = 0) -> str:
    """Save a tiny random causal LM and its char tokenizer to ``path``; return the path."""
    tokenizer = build_char_tokenizer(ALPHABET)
    model = build_tiny_causal_lm(len(tokenizer), architecture=architecture, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def write_prompts(path: Path, num_rows: int = 24, conversational: bool = False) -> str:
    """A jsonl file of ``a+b=`` prompts with an ``answer`` column."""
    with open(path, "w") as f:
        for i in range(num_rows):
            a, b = i % 10, (3 * i) % 10
            prompt = [{"role": "user", "content": f"{a}+{b}="}] if conversational else f"{a}+{b}="
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    return str(path)


def length_reward(completions, **kwargs):
    """Longer completions score higher: varied rewards, so advantages are non-zero."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t)) for t in texts]


def count_a_reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(t.count("a")) for t in texts]


def length_reward_with_extras(completions, log_extra=None, log_metric=None, **kwargs):
    """``length_reward`` that also logs a table column and a scalar metric."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    if log_extra is not None:
        log_extra("num_chars", [len(t) for t in texts])
    if log_metric is not None:
        log_metric("my_metric", 3.0)
    return [float(len(t)) for t in texts]


def none_for_odd_answers(completions, answer, **kwargs):
    """Not applicable (None) to prompts with an odd answer: a multi-task reward."""
    return [None if int(a) % 2 else float(len(c)) for c, a in zip(completions, answer)]


def built(module):
    """``module`` with its models built (``configure_model``), as a Trainer would before fitting."""
    module.configure_model()
    return module


_PORTS_HANDED_OUT: set[int] = set()
_PORT_RNG = random.SystemRandom()  # not reseeded by tests that seed ``random``


def _ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing and port-0 sockets (Linux default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _non_ephemeral_ports() -> tuple[int, int]:
    """``[low, high)``: the wider of the gaps below (from 20000, clear of well-known service ports)
    and above the ephemeral range."""
    low_ephemeral, high_ephemeral = _ephemeral_port_range()
    below, above = (20000, low_ephemeral), (high_ephemeral + 1, 65536)
    low, high = max(below, above, key=lambda gap: gap[1] - gap[0])
    if high - low < 100:
        raise RuntimeError(f"ephemeral port range {low_ephemeral}-{high_ephemeral} leaves no ports for test "
                           "servers; narrow net.ipv4.ip_local_port_range")
    return low, high


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a child process to bind later.

    Binding port 0 would hand out an *ephemeral* port, and between closing it here and the child
    binding it the kernel may give that same port to any outgoing connection (gloo's own pair
    sockets, the rendezvous client): the child then fails with "address already in use". So pick
    at random outside the ephemeral range, where the kernel never assigns ports on its own, check
    the port binds, and never hand the same one out twice in this test process.
    """
    low, high = _non_ephemeral_ports()
    for _ in range(200):
        port = _PORT_RNG.randrange(low, high)
        if port in _PORTS_HANDED_OUT:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) after 200 tries")


def count_forward_paths() -> dict[str, int]:
    """Counts, from now on in this process, the log-prob forwards that take the plain and the
    optimized path (``module/forward.py``): for the multi-process children, whose strategies must
    keep the optimized path."""
    import grpo_lightning.module.forward as forward_code

    paths = {"plain": 0, "optimized": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            paths[name] += 1
            return function(*args, **kwargs)

        return call

    forward_code._plain_logprobs = counted("plain", forward_code._plain_logprobs)
    forward_code._optimized_logprobs = counted("optimized", forward_code._optimized_logprobs)
    return paths
