"""What every benchmark shares: sizes, the machine, the shipped model, tables, JSON.

A benchmark module exposes ``run(size, args) -> dict`` (the result, with the keys
``RESULT_KEYS``) and ``main(args)``, which runs it, prints its tables and writes
``<out>/<name>-<size>.json``. Timings live here, never in tests: the smoke test only
checks that each benchmark still produces its JSON.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

SIZES = ("tiny", "small", "full")

# Every result JSON has these keys (the smoke test checks them).
RESULT_KEYS = ("benchmark", "size", "command", "machine", "config", "results", "goals", "wall_s")

# The shipped Shakespeare model's shape (scripts/train_shakespeare.py defaults). When the
# checkpoint is missing (still training), benchmarks that need the real model use a random
# Llama of this shape, so the step costs stay representative.
SHIPPED_SHAPE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)


# --------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict:
    """CPU model, cores, load, library versions and the device, as printed under each table. A benchmark
    that ran no torch (the simulator's) gets the installed versions without importing torch or transformers,
    and ``torch_threads`` None."""
    torch = sys.modules.get("torch")
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else installed_version("torch"),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "device": device,
        "transformers": installed_version("transformers"),
    }
    if torch is not None and device.startswith("cuda") and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
    return info


def installed_version(package: str) -> Optional[str]:
    """The installed version of ``package`` (its metadata: nothing is imported), or None."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_line(m: dict) -> str:
    threads = "not imported" if m["torch_threads"] is None else f"{m['torch_threads']} threads"
    s = (
        f"machine: {m['cpu']}, {m['cores_usable']}/{m['cores']} cores usable, load {m['load_avg_1m']}, "
        f"torch {m['torch']} ({threads}), transformers {m.get('transformers')}, "
        f"device {m['device']}"
    )
    if m.get("device_name"):
        s += f" ({m['device_name']})"
    return s


def command_line(name: str, args) -> str:
    cmd = f"python -m minillm.bench {name} --size {args.size}"
    if getattr(args, "threads", None):
        cmd += f" --threads {args.threads}"
    if getattr(args, "device", "cpu") != "cpu":
        cmd += f" --device {args.device}"
    if getattr(args, "model", "shipped") != "shipped" and name == "throughput":
        cmd += f" --model {args.model}"
    if getattr(args, "repeat", 1) > 1 and name == "throughput":
        cmd += f" --repeat {args.repeat}"
    return cmd


def set_threads(args) -> int:
    """One torch thread count for the whole process, so every side of a comparison gets it."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(int(args.threads))
    return torch.get_num_threads()


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


def shipped_model_available() -> bool:
    from ..model.loader import DEFAULT_MODEL_DIR

    return (DEFAULT_MODEL_DIR / "config.json").exists() and any(DEFAULT_MODEL_DIR.glob("*.safetensors"))


def make_llm(**config):
    """``LLM()`` on the shipped model; a random Llama of the shipped shape if it is missing.

    Returns (llm, model_label)."""
    from .. import LLM

    if shipped_model_available():
        return LLM(**config), "shipped shakespeare checkpoint"
    llm = LLM("random", random_model=dict(SHIPPED_SHAPE), **config)
    return llm, "random Llama of the shipped shape (checkpoint missing)"


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


def progress(total: Optional[int] = None, desc: str = "", unit: str = "it", **kw):
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True, mininterval=0.5, **kw
    )


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (intercept a, slope b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def loglog_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The exponent k of y ~ x^k (slope of the log-log fit): 1 = linear, 2 = quadratic."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return float("nan")
    return fit_line([p[0] for p in pts], [p[1] for p in pts])[1]


def step_clock() -> tuple[Callable[[], float], str]:
    """The clock to time engine parts with: this process's CPU time when torch runs one thread
    (a shared machine then cannot inflate a part by descheduling us), else wall time."""
    import torch

    if torch.get_num_threads() == 1:
        return time.process_time, "CPU time"
    return time.perf_counter, "wall time"


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 10**-digits):
            return f"{v:.{digits}g}"
        return f"{v:,.{digits}f}".rstrip("0").rstrip(".") if abs(v) < 1e3 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def pct(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: Optional[str] = None) -> str:
    """A markdown table (pipes, aligned), so the printout pastes into a README as is."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    out = [] if title is None else [f"\n### {title}\n"]
    out.append(line(cells[0]))
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def goal(name: str, target: str, value: Any, met: Optional[bool]) -> dict:
    """One goal of a benchmark: what we aim for, what this run measured, met or not."""
    return {"goal": name, "target": target, "measured": value, "met": met}


def goals_table(goals: Sequence[dict]) -> str:
    return table(
        ["goal", "target", "measured", "met"],
        [[g["goal"], g["target"], g["measured"], g["met"]] for g in goals],
        title="goals",
    )


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def finish(name: str, args, result: dict, tables: Sequence[str], t_start: float) -> dict:
    """Add the common keys, print the tables + machine + command, write the JSON; returns it."""
    result.setdefault("benchmark", name)
    result.setdefault("size", args.size)
    result.setdefault("command", command_line(name, args))
    result.setdefault("machine", machine_info(getattr(args, "device", "cpu")))
    result.setdefault("config", {})
    result.setdefault("results", {})
    result.setdefault("goals", [])
    result["wall_s"] = round(time.perf_counter() - t_start, 3)
    print(f"\n## minillm.bench {name} (size {args.size})")
    for t in tables:
        print(t)
    if result["goals"]:
        print(goals_table(result["goals"]))
    print()
    print(machine_line(result["machine"]))
    print(f"command: {result['command']}   (wall {result['wall_s']:.1f}s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{args.size}.json"
    path.write_text(json.dumps(_jsonable(result), indent=2) + "\n", encoding="utf-8")
    print(f"results: {path}")
    result["json_path"] = str(path)
    return result


def pick(size: str, tiny, small, full):
    return {"tiny": tiny, "small": small, "full": full}[size]
