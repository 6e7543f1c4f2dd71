"""``pagedflash bench online``: load an OpenAI-compatible server over HTTP and measure it as its
users' clients see it (this project's ``pagedflash serve`` or any other URL).

Workloads, arrivals, the client and the per-request metrics are :mod:`pagedflash.bench.loadgen`'s
(its docstring says how each figure is counted). Every sweep point (``--request-rates`` x
``--max-concurrency``) sends the same prompt and output lengths with new token ids (a prefix cache
never hits across points; ShareGPT text is sent again as it is), after ``--num-warmups`` requests
that are not counted. Reported per point: request, input and output token throughput; TTFT, TPOT,
ITL and end-to-end latency (mean, p50, p90, p99, ms); goodput (requests/s that met every bound of
``--goodput``, vLLM's option). Files under ``--out``: ``<name>.json`` (every figure, the arguments),
``<name>.md`` (tables), ``<name>.png`` (latency against achieved load, for two or more points) and,
with ``--save-requests``, ``<name>_requests.json`` (each request's timings). ``--client-processes
N`` sends each point from N client processes (:mod:`pagedflash.bench.loadgen_procs`; each caps its
share of ``--max-concurrency``), for when one process's CPU (the ``client CPU %`` column, the
busiest process's) nears 100 %.

``--launch-server [ARGS...]`` (the last option: everything after it goes to the server) starts
``python -m pagedflash serve ARGS --host 127.0.0.1 --port <free>`` (``--server-command`` names
another command that takes ``--host``/``--port``), waits for ``/health``, runs, and stops it with
SIGTERM (SIGKILL after ``--server-grace`` s); its log goes to ``<name>_server.log``. A pagedflash
server started this way is then compared with the offline engine on the same workload: after the
server has exited, a fresh process runs ``LLM.generate`` on point 0's prompts with the server's
engine arguments (:mod:`pagedflash.bench.online_offline`), once per concurrency cap of the sweep
(the cap as ``max_num_seqs``), and each point reports online output tok/s over offline's. That
ratio is the server's overhead where the server is saturated (rate ``inf``); at lower rates it
measures the arrival rate instead.

Exit status: 0 when every request of every point succeeded, 1 when some failed (their first error
is printed and kept in the JSON), 2 for bad arguments or a server that did not come up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pagedflash.bench import loadgen, loadgen_procs
from pagedflash.bench.report import Table, _jsonable, plot, print_summary, print_table, write_results

DATASETS = ("random", "shared-prefix", "sharegpt")
DEFAULT_SERVER = "{python} -m pagedflash serve"
QUICK = dict(num_prompts=4, input_len="4:12", output_len="2:4", prefix_len=16, suffix_len="2:4")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI (tokens), got {text!r}") from None


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected request rates > 0 separated by commas (inf allowed), got {text!r}")
    return rates


def _concurrencies(text: str) -> list[int]:
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        caps = []
    if not caps or any(c < 1 for c in caps):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by commas, got {text!r}")
    return caps


def _json_object(text: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return doc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedflash bench online", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000", help="the server (ignored with --launch-server)")
    a("--model", default=None, help="model name sent in each request (default: the first of GET /v1/models)")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    a("--dataset", choices=DATASETS, default="random")
    a("--dataset-path", type=Path, default=None, help="sharegpt: the ShareGPT-format JSON file")
    a("--num-prompts", type=int, default=None, help="requests per sweep point (default 200; --quick 8)")
    a("--input-len", type=_range, default=None, help="random: prompt tokens, N or LO:HI (default 100:1024)")
    a("--output-len", type=_range, default=None, help="random, shared-prefix: max_tokens, N or LO:HI (default 100:1024)")
    a("--prefix-groups", type=int, default=8, help="shared-prefix: number of distinct system prompts")
    a("--prefix-len", type=int, default=None, help="shared-prefix: system prompt tokens (default 1024)")
    a("--suffix-len", type=_range, default=None, help="shared-prefix: unique suffix tokens, N or LO:HI (default 128)")
    a("--sharegpt-max-len", type=int, default=2048, help="sharegpt: skip conversations longer (prompt + output)")
    a("--tokenizer", default=None, help="tokenizer.json (or a directory holding one): token ids for random "
                                       "prompts and ShareGPT lengths in tokens")
    a("--vocab-size", type=int, default=None, help="random token ids are drawn below this (default: the "
                                                     "tokenizer's, or the launched server's model's)")
    a("--request-rate", type=float, default=math.inf, help="Poisson arrivals, requests/s (inf: all at once)")
    a("--request-rates", type=_rates, default=None, help="a sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    a("--max-concurrency", type=_concurrencies, default=None, help="requests in flight at most (a comma list sweeps)")
    a("--client-processes", type=int, default=1, help="client processes sending each point's requests (raise it "
      "when client CPU %% nears 100; each caps its share of --max-concurrency)")
    a("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLO for goodput, e.g. ttft:500 tpot:50 (e2el too)")
    a("--num-warmups", type=int, default=1, help="uncounted requests before each point")
    a("--timeout", type=float, default=600.0, help="seconds per request; a slower one fails")
    a("--temperature", type=float, default=0.0)
    a("--no-ignore-eos", action="store_true", help="let requests stop at EOS (outputs may be shorter)")
    a("--extra-body", type=_json_object, default=None, help="JSON object merged into every request body")
    a("--seed", type=int, default=0)
    a("--out", type=Path, default=Path("bench_results"))
    a("--result-name", default="online", help="file names under --out")
    a("--save-requests", action="store_true", help="also write each request's timings")
    a("--quick", action="store_true", help="a few short requests: a smoke run")
    a("--server-command", default=DEFAULT_SERVER, help="with --launch-server: the command ({python}: this Python)")
    a("--server-timeout", type=float, default=900.0, help="seconds for a launched server to answer /health")
    a("--server-grace", type=float, default=30.0, help="seconds after SIGTERM before SIGKILL")
    a("--no-offline", action="store_true", help="with --launch-server: skip the offline engine comparison")
    a("--launch-server", nargs=argparse.REMAINDER, default=None, metavar="SERVER_ARGS",
      help="start the server here with these arguments (must come last)")
    return p


def _resolve(args, p: argparse.ArgumentParser) -> None:
    """Defaults that depend on --quick, and checks argparse cannot make."""
    full = dict(num_prompts=200, input_len="100:1024", output_len="100:1024", prefix_len=1024, suffix_len="128")
    for key, value in (QUICK if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, _range(value) if isinstance(value, str) else value)
    if args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "sharegpt" and args.dataset_path is None:
        p.error("--dataset sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)")
    if args.client_processes < 1:
        p.error(f"--client-processes must be >= 1, got {args.client_processes}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        args.slo = loadgen.parse_goodput(args.goodput or [])
    except ValueError as e:
        p.error(str(e))


# ---------------------------------------------------------------- workloads


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"--tokenizer: no tokenizer file at {file!r}")
    tok = Tokenizer.from_file(file)

    class Encoder:  # ids without special tokens: lengths are what the text holds
        vocab_size = tok.get_vocab_size()
        special = sorted(tok.get_added_tokens_decoder()) if hasattr(tok, "get_added_tokens_decoder") else []

        @staticmethod
        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

    return Encoder


def _token_space(args, tokenizer, server_vocab: int | None) -> loadgen.TokenSpace:
    if tokenizer is not None:
        return loadgen.TokenSpace(tokenizer.vocab_size, excluded=tokenizer.special or (0, 1, 2))
    vocab = args.vocab_size or server_vocab
    if vocab is None:
        raise ValueError(f"--dataset {args.dataset} sends token ids: give --tokenizer PATH or --vocab-size N "
                         "(ids are drawn below it, 0-2 excluded)")
    return loadgen.TokenSpace(vocab)


def build_workload(args, n: int, tokenizer, tokens: loadgen.TokenSpace | None, content_seed) -> list[loadgen.Request]:
    """``n`` requests of ``args.dataset``; lengths from ``args.seed``, tokens from ``content_seed``."""
    if args.dataset == "random":
        return loadgen.random_requests(n, input_len=args.input_len, output_len=args.output_len, tokens=tokens,
                                       seed=args.seed, content_seed=content_seed)
    if args.dataset == "shared-prefix":
        return loadgen.shared_prefix_requests(n, groups=args.prefix_groups, system_len=args.prefix_len,
                                              suffix_len=args.suffix_len, output_len=args.output_len,
                                              tokens=tokens, seed=args.seed, content_seed=content_seed)
    return loadgen.sharegpt_requests(args.dataset_path, n, tokenizer=tokenizer, seed=args.seed,
                                     max_len=args.sharegpt_max_len)


def _points(args) -> list[tuple[float, int | None]]:
    rates = args.request_rates or [args.request_rate]
    return [(r, c) for c in (args.max_concurrency or [None]) for r in rates]


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """``command`` + ``--host 127.0.0.1 --port <free>`` in its own session (process group), output
    to ``log``; :meth:`wait_ready` polls ``/health`` until a deadline; :meth:`stop` sends SIGTERM,
    then SIGKILL to the whole group (worker processes too) after ``grace`` seconds, and returns the
    exit code."""

    def __init__(self, command: list[str], log: Path, grace: float = 30.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grace = grace
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115  (closed in stop)
        self.command = [*command, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before answering /health; "
                                   f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout:g} s; its log ({self.log_path}) "
                           f"ends:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"GET {base_url}/v1/models failed ({type(e).__name__}: {e}); is the server up?") from e
    if not data:
        raise RuntimeError(f"GET {base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


# ---------------------------------------------------------------- run


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    _resolve(args, p)
    server, launched_pagedflash = None, False
    try:
        tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
        server_vocab = None
        if args.launch_server is not None:
            launched_pagedflash = args.server_command == DEFAULT_SERVER
            if launched_pagedflash and args.dataset != "sharegpt" and tokenizer is None and args.vocab_size is None:
                from pagedflash.bench.online_offline import server_model_config

                server_vocab = server_model_config(args.launch_server).vocab_size
        tokens = None if args.dataset == "sharegpt" else _token_space(args, tokenizer, server_vocab)
        workloads = [build_workload(args, args.num_prompts, tokenizer, tokens, f"{args.seed}:{i}")
                     for i in range(len(_points(args)))]
        warmups = _warmups(args, tokenizer, tokens)
    except (ValueError, ImportError) as e:
        print(f"bench online: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # the server's own parser refused --launch-server's arguments
        return e.code if isinstance(e.code, int) else 2
    if args.launch_server is not None:
        command = shlex.split(args.server_command.format(python=shlex.quote(sys.executable))) + args.launch_server
        server = LaunchedServer(command, args.out / f"{args.result_name}_server.log", args.server_grace)
        print(f"bench online: starting {' '.join(server.command)}", flush=True)
    try:
        if server is not None:
            server.wait_ready(args.server_timeout)
            args.base_url = server.url
        runs = _run_points(args, workloads, warmups)
    except RuntimeError as e:
        print(f"bench online: {e}", file=sys.stderr)
        return 2
    finally:  # whatever happened (Ctrl-C too), a server started here is stopped
        if server is not None:
            code = server.stop()
            print(f"bench online: server stopped (exit {code}; log {server.log_path})", flush=True)
    offline = {}
    if launched_pagedflash and not args.no_offline:
        offline = _offline(args, workloads[0], warmups)
    _report(args, runs, offline)
    return 1 if any(r["summary"]["failed"] for r in runs) else 0


def _warmups(args, tokenizer, tokens) -> list[loadgen.Request]:
    """Uncounted requests: new tokens (ShareGPT: the conversations after the run's)."""
    if args.num_warmups < 1:
        return []
    if args.dataset == "sharegpt":
        n = args.num_prompts
        return build_workload(args, n + args.num_warmups, tokenizer, tokens, None)[n:]
    return build_workload(args, args.num_warmups, tokenizer, tokens, f"{args.seed}:warmup")


def _run_points(args, workloads, warmups) -> list[dict]:
    model = args.model or first_model(args.base_url, args.api_key)
    args.model = model
    kw = dict(base_url=args.base_url, model=model, timeout=args.timeout, api_key=args.api_key,
              ignore_eos=not args.no_ignore_eos, temperature=args.temperature, extra_body=args.extra_body)
    pool = loadgen_procs.ClientPool(args.client_processes) if args.client_processes > 1 else None
    try:
        return [_run_point(args, i, rate, cap, requests, warmups, pool, kw)
                for i, ((rate, cap), requests) in enumerate(zip(_points(args), workloads))]
    finally:
        if pool is not None:
            pool.close()


def _run_point(args, i, rate, cap, requests, warmups, pool, kw) -> dict:
    if warmups:  # in this process: they warm the server, not the client processes' connections
        results, _, _ = loadgen_procs.run_point(warmups, max_concurrency=cap, **kw)
        if bad := [r.error for r in results if not r.ok]:
            print(f"bench online: warmup failed: {bad[0]}", file=sys.stderr)
    results, duration, cpu_pct = loadgen_procs.run_point(requests, pool=pool, rate=rate, seed=args.seed + i,
                                                         max_concurrency=cap, **kw)
    s = loadgen.summarize(results, duration, args.slo)
    s["client_cpu_pct"] = cpu_pct  # near 100: the client limits (raise --client-processes)
    print(f"rate {rate:g} req/s, concurrency {cap or '-'}: {s['completed']}/{len(results)} done in "
          f"{duration:.2f} s, {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
          f"TTFT p50 {_ms(s['ttft_p50_ms'])}, TPOT p50 {_ms(s['tpot_p50_ms'])}, client CPU {cpu_pct:.0f} %",
          flush=True)
    if s["failed"]:
        print(f"  {s['failed']} failed; first: {s['first_error']}", file=sys.stderr)
    return dict(rate=rate, max_concurrency=cap, summary=s, results=results)


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _offline(args, requests, warmups) -> dict:
    """Output tok/s of the offline engine on ``requests``, per concurrency cap (None: uncapped)."""
    from pagedflash.bench.online_offline import run_in_subprocess

    out = {}
    for cap in dict.fromkeys(args.max_concurrency or [None]):
        spec = dict(server_args=args.launch_server, prompts=[r.prompt for r in requests],
                    max_tokens=[r.max_tokens for r in requests], warmup=[r.prompt for r in warmups],
                    warmup_max_tokens=[r.max_tokens for r in warmups],
                    ignore_eos=not args.no_ignore_eos, temperature=args.temperature, max_num_seqs=cap)
        print(f"bench online: offline engine, same workload (max_num_seqs cap {cap or '-'})", flush=True)
        try:
            out[cap] = run_in_subprocess(spec, timeout=max(args.server_timeout, args.timeout * 2))
            print(f"  offline: {out[cap]['output_tokens_per_s']:.1f} output tok/s in {out[cap]['elapsed_s']:.2f} s",
                  flush=True)
        except RuntimeError as e:
            print(f"bench online: the offline run failed: {e}", file=sys.stderr)
            out[cap] = {"error": str(e)[:300]}
    return out


# ---------------------------------------------------------------- report

RUN_COLUMNS = {"rate": "rate req/s", "max_concurrency": "max conc.", "completed": "done", "failed": "failed",
               "duration_s": "s", "request_throughput": "req/s", "input_throughput": "in tok/s",
               "output_throughput": "out tok/s", "ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms",
               "tpot_p50_ms": "TPOT p50 ms", "tpot_p99_ms": "TPOT p99 ms", "itl_p50_ms": "ITL p50 ms",
               "e2el_p50_ms": "E2E p50 ms", "client_cpu_pct": "client CPU %"}


def _report(args, runs, offline) -> None:
    rows = []
    for run in runs:
        row = dict(rate=run["rate"], max_concurrency=run["max_concurrency"], **run["summary"])
        off = offline.get(run["max_concurrency"], {})
        if "output_tokens_per_s" in off:
            row["offline_output_throughput"] = off["output_tokens_per_s"]
            row["online_over_offline"] = row["output_throughput"] / off["output_tokens_per_s"]
        if off.get("itl_p50_ms") and row["itl_p50_ms"] is not None:
            row["offline_itl_p50_ms"] = off["itl_p50_ms"]
            row["itl_over_offline"] = row["itl_p50_ms"] / off["itl_p50_ms"]
        rows.append(row)
    columns = dict(RUN_COLUMNS)
    if args.slo:
        columns["goodput"] = "goodput req/s"
    if offline:
        columns.update(offline_output_throughput="offline out tok/s", online_over_offline="online/offline",
                       offline_itl_p50_ms="offline ITL p50 ms", itl_over_offline="ITL x offline")
    what = (f"{args.num_prompts} requests, dataset {args.dataset}, model {args.model}, "
            f"{'ignore_eos' if not args.no_ignore_eos else 'EOS allowed'}")
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in args.slo.items())
    runs_table = Table("runs", f"Online: {what}", columns, rows,
                       note="ms: milliseconds; TPOT = (e2e - TTFT) / (output tokens - 1); client CPU %: the busiest "
                            "client process's CPU time over the run's (near 100, the client limits what is "
                            "measured: raise --client-processes)"
                            + (f"; goodput: requests/s meeting {slo}" if slo else "")
                            + ("; online/offline: output tok/s over the offline engine's on the same requests "
                               "(the server's overhead where it is saturated, rate inf); ITL x offline: ITL p50 "
                               "over the offline engine's (batch 1: --max-concurrency 1)" if offline else ""))
    lat_rows = [dict(rate=r["rate"], max_concurrency=r["max_concurrency"], metric=m,
                     **{k: r[f"{m}_{k}_ms"] for k in ("mean", "p50", "p90", "p99")})
                for r in rows for m in loadgen.METRICS]
    latency = Table("latency", "Latency (ms) per point", {"rate": "rate req/s", "max_concurrency": "max conc.",
                    "metric": "metric", "mean": "mean", "p50": "p50", "p90": "p90", "p99": "p99"}, lat_rows)
    for t in (runs_table, latency):
        print_table(t)
    summary = {"points": len(rows), "failed": sum(r["failed"] for r in rows),
               "best_output_throughput": max(r["output_throughput"] or 0.0 for r in rows)}
    ratios = [r["online_over_offline"] for r in rows if "online_over_offline" in r]
    if ratios:
        summary["best_online_over_offline"] = max(ratios)
    print_summary(summary)
    path = write_results(args.result_name, [runs_table, latency], args.out, quick=args.quick, summary=summary)
    doc = json.loads(path.read_text())
    doc["args"] = _jsonable({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    doc["offline"] = _jsonable({"uncapped" if k is None else str(k): v for k, v in offline.items()})
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {path}")
    if args.save_requests:
        detail = [dict(rate=r["rate"], max_concurrency=r["max_concurrency"],
                       requests=[asdict(x) for x in r["results"]]) for r in runs]
        (args.out / f"{args.result_name}_requests.json").write_text(json.dumps(detail, default=str))
    if len(rows) > 1:
        png = _plot(args.out / f"{args.result_name}.png", rows)
        if png:
            print(f"wrote {png}")


def _plot(path: Path, rows: list[dict]) -> Path | None:
    """TTFT and TPOT (p50, p99) against achieved request rate and output throughput, one line per
    concurrency cap."""
    panels = []
    for x_key, x_label in (("request_throughput", "achieved requests/s"), ("output_throughput", "output tokens/s")):
        for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
            series = {}
            for cap in dict.fromkeys(r["max_concurrency"] for r in rows):
                sel = sorted((r for r in rows if r["max_concurrency"] == cap and r[x_key] is not None),
                             key=lambda r: r[x_key])
                tag = "" if cap is None else f", conc. {cap}"
                for p in ("p50", "p99"):
                    series[f"{p}{tag}"] = ([r[x_key] for r in sel], [r[f"{metric}_{p}_ms"] for r in sel])
            panels.append({"title": f"{name} vs {x_label}", "xlabel": x_label, "ylabel": f"{name} ms",
                           "series": series})
    return plot(path, panels, ncols=2, logx=False)


if __name__ == "__main__":
    sys.exit(main())
