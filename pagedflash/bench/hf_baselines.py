"""The transformers baselines of ``pagedflash bench serve``'s throughput section: a padded static-batch
``generate`` with SDPA and transformers' own continuous batching (``init_continuous_batching``, the
manager behind ``generate_batch``), on the very checkpoint the engine loads. Each returns (requested
tokens produced, seconds, note)."""

from __future__ import annotations

import time

import torch

from pagedflash._progress import progress


def quiet_transformers() -> None:
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


def load_hf(model_dir):
    import transformers

    on_gpu = torch.cuda.is_available()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if on_gpu else torch.float32, attn_implementation="sdpa")
    return model.to("cuda" if on_gpu else "cpu").eval()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def static_batches(model, prompts, out_lens, batch_size, timeout: float) -> tuple[int, float, str]:
    """Padded static batches (left padding), each generating its longest requested output.
    Returns (requested tokens produced, seconds, note); batches stop starting after ``timeout`` s."""
    dev = model.device
    order = sorted(range(len(prompts)), key=lambda i: -out_lens[i])
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def run(idx, warm=False):
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        m = 4 if warm else max(out_lens[i] for i in idx)
        model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=m, min_new_tokens=m,
                       do_sample=False, pad_token_id=0)

    run(batches[0][:2], warm=True)
    _sync()
    t0 = time.perf_counter()
    done = []
    for idx in progress(batches, desc="transformers static"):
        if done and time.perf_counter() - t0 > timeout:
            break
        run(idx)
        _sync()
        done.append(idx)
    secs = time.perf_counter() - t0
    generated = sum(max(out_lens[i] for i in idx) * len(idx) for idx in done)
    useful = sum(out_lens[i] for idx in done for i in idx)
    part = "" if len(done) == len(batches) else f"; rate over the first {len(done)} of {len(batches)} batches"
    return useful, secs, f"{generated} generated incl. padding waste{part}"


@torch.inference_mode()
def continuous_batching(model, prompts, out_lens, _batch_size, timeout: float) -> tuple[int, float, str]:
    """transformers' continuous-batching manager with per-request lengths, no EOS. Returns (tokens,
    seconds, note); unfinished after ``timeout`` s, it reports all requested tokens over the timeout:
    an upper bound of its rate (so a ratio against it is a lower bound)."""
    import transformers

    gen = transformers.GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, pad_token_id=0)
    kw = {}
    if not torch.cuda.is_available():  # off the GPU it cannot size its cache from free memory
        kw["continuous_batching_config"] = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)
    manager = model.init_continuous_batching(generation_config=gen, **kw)
    manager.start()
    try:
        manager.add_request([1, 2, 3, 4], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        _collect(manager, {"warmup"}, timeout=600)
        ids = {f"r{i}" for i in range(len(prompts))}
        t0 = time.perf_counter()
        for i, (p, m) in enumerate(zip(prompts, out_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
        try:
            results = _collect(manager, ids, timeout=timeout)
        except TimeoutError as e:
            return sum(out_lens), time.perf_counter() - t0, f"{e}: tok/s is an upper bound"
        secs = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=60)
    got = sum(len(r.generated_tokens) for r in results.values())
    if got != sum(out_lens):
        raise RuntimeError(f"produced {got} tokens, expected {sum(out_lens)}")
    attn = getattr(model.config, "_attn_implementation", "?")
    return got, secs, f"attn {attn}"


def _collect(manager, ids: set[str], timeout: float) -> dict:
    results, deadline = {}, time.perf_counter() + timeout
    bar = progress(desc="transformers CB", total=len(ids))
    while len(results) < len(ids):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(ids) - len(results)} requests unfinished after {timeout:.0f}s")
        r = manager.get_result(timeout=1.0)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("the continuous-batching thread stopped")
            continue
        if r.request_id in ids and r.is_finished():
            if getattr(r, "error", None):
                raise RuntimeError(f"request {r.request_id}: {r.error}")
            results[r.request_id] = r
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return results
