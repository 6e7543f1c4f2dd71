"""The offline side of ``bench online``'s overhead ratio: ``LLM.generate`` on the workload the
server was sent, with the engine the server builds from the same arguments (its own code), in a
fresh process started once the server has exited (the two never share a GPU).

``python -m pagedflash.bench.online_offline SPEC OUT`` reads SPEC (JSON: ``server_args``, the
arguments ``pagedflash serve`` got; ``prompts``; ``max_tokens``, one per prompt; ``warmup`` and
``warmup_max_tokens``, requests run first and not counted (text prompts are encoded by the
server's tokenizer, as the server encodes them); ``ignore_eos``; ``temperature``;
``max_num_seqs``, a cap or null) and writes OUT (JSON: the engine's ``last_stats`` plus TTFT and
inter-token latency mean, p50 and p99 in ms).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def server_model_config(server_args: list[str]):
    """The :class:`ModelConfig` a ``pagedflash serve`` started with ``server_args`` serves (its own
    argument parser reads them: a bad argument exits 2 here as it would there)."""
    from pagedflash.engine.config import TINY_LLAMA, ModelConfig
    from pagedflash.entrypoints.openai.api_server import parse_args

    model = parse_args(server_args).model
    return ModelConfig.from_pretrained(model) if model else ModelConfig.from_dict(TINY_LLAMA)


def server_state(server_args: list[str], max_num_seqs: int | None = None):
    """What a ``pagedflash serve`` started with ``server_args`` builds (its engine, not started, and
    its tokenizer), by the server's own code; ``max_num_seqs`` caps the running sequences."""
    from pagedflash.entrypoints.openai.api_server import build_state, parse_args

    args = parse_args(server_args)
    args.engine_process = False  # the offline engine runs here, whatever process the server gave it
    args.request_timeline = None  # the server's, not the offline engine's
    if max_num_seqs:
        args.max_num_seqs = min(args.max_num_seqs, max_num_seqs)
    return build_state(args)


def run(spec: dict) -> dict:
    from pagedflash.bench.loadgen import percentile
    from pagedflash.engine import SamplingParams

    opts = dict(ignore_eos=spec["ignore_eos"], temperature=spec["temperature"])
    state = server_state(spec["server_args"], spec.get("max_num_seqs"))
    ids = lambda prompts: [state.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]  # as served
    with state.engine.llm as llm:
        if spec["warmup"]:
            llm.generate(ids(spec["warmup"]), [SamplingParams(max_tokens=m, **opts) for m in spec["warmup_max_tokens"]])
        outs = llm.generate(ids(spec["prompts"]), [SamplingParams(max_tokens=m, **opts) for m in spec["max_tokens"]])
        stats = dict(llm.last_stats)
    ok = [o for o in outs if o.finish_reason != "error"]
    for name, xs in (("ttft", [1e3 * o.ttft for o in ok]), ("itl", [1e3 * x for o in ok for x in o.itl])):
        if xs:
            stats.update({f"{name}_mean_ms": sum(xs) / len(xs), f"{name}_p50_ms": percentile(xs, 50),
                          f"{name}_p99_ms": percentile(xs, 99)})
    stats["errors"] = [o.error for o in outs if o.finish_reason == "error"][:3]
    return stats


def run_in_subprocess(spec: dict, *, timeout: float) -> dict:
    """:func:`run` in a fresh Python process (this one's interpreter and environment)."""
    with tempfile.TemporaryDirectory(prefix="pagedflash_offline_") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        try:
            proc = subprocess.run([sys.executable, "-m", "pagedflash.bench.online_offline", str(spec_path),
                                   str(out_path)], capture_output=True, text=True, timeout=timeout,
                                  env=dict(os.environ))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the offline engine ran past {timeout:g} s") from None
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-10:])
            raise RuntimeError(f"the offline engine exited with {proc.returncode}:\n{tail}")
        return json.loads(out_path.read_text())


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])
    stats = run(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
