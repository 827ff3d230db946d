"""The harness's tables (markdown, printed and kept in the JSON) and its plot.

Ratios are Tandem / peer in speed: tokens/s over tokens/s, and for times the peer's time over
Tandem's, so above 1 always means Tandem is faster. "Floor" is the lower of the weight-bandwidth
and compute bounds, from the best floor sample of the same run (`floors.py`); the fraction is
measured / floor for speeds and floor / measured for times.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from floors import Floors, ModelCost, best

# (engine key in the JSON, label); the first of each group is Tandem's in-process engine.
TOKEN_ENGINES = (("tandem", "Tandem"), ("tandem-grpc", "Tandem gRPC"), ("transformers", "transformers"),
                 ("vllm", "vLLM CPU"))  # fmt: skip
EMBED_ENGINES = (("tandem-embeds", "Tandem"), ("transformers-embeds", "transformers"),
                 ("vllm-embeds", "vLLM CPU"))  # fmt: skip
COLORS = {"Tandem": "C0", "Tandem gRPC": "C1", "transformers": "C2", "vLLM CPU": "C3"}


def _median(entry: dict | str | None, key: int) -> float | None:
    if not isinstance(entry, dict):
        return None
    row = entry.get(key) or entry.get(str(key))
    return row["median"] if row else None


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _decode_table(
    decode: dict, engines: tuple, sizes: list[int], floors: Floors, cost: ModelCost
) -> tuple[list[str], dict]:
    """One row per N: tokens/s of every engine that ran, Tandem / each peer, the floor."""
    ran = [(key, label) for key, label in engines if not isinstance(decode.get(key), str)]
    (base, base_label), peers = ran[0], ran[1:]
    header = ["N", *(f"{label} tok/s" for _, label in ran)]
    header += [f"{base_label} / {label}" for _, label in peers] + ["floor tok/s", f"{base_label} / floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios: dict = {}
    for n in sizes:
        rates = {key: _median(decode.get(key), n) for key, _ in ran}
        floor = floors.decode_tok_s(cost, n)
        row = [str(n), *(_fmt(rates[key]) for key, _ in ran)]
        for key, _ in peers:
            ratio = _ratio(rates[base], rates[key])
            ratios.setdefault(f"{base}/{key}", {})[n] = ratio
            row.append(_fmt(ratio, ".2f", "x"))
        fraction = _ratio(rates[base], floor)
        ratios.setdefault(f"{base}/floor", {})[n] = fraction
        row += [f"{floor:.0f}", _fmt(None if fraction is None else 100 * fraction, ".1f", "%")]
        lines.append("| " + " | ".join(row) + " |")
    skipped = [f"{label}: {decode[key]}" for key, label in engines if isinstance(decode.get(key), str)]
    return lines + ([f"\n{'; '.join(skipped)}"] if skipped else []), ratios


def print_report(payload: dict) -> dict:
    """Print the tables; return them (markdown lines) and every ratio, for the JSON."""
    settings, decode = payload["settings"], payload["decode_tok_s"]
    cost, sizes = ModelCost(**settings["cost"]), settings["sizes"]
    samples = [Floors(**f) for f in payload["floors"]]
    floors = best(samples)
    sections: dict[str, list[str]] = {}
    ratios: dict = {}
    reads = [f.read_gb_per_s for f in samples]
    rates = [f.matmul_bf16_gflops for f in samples]
    sections["floors"] = [
        f"| measure ({len(samples)} samples in the run) | lowest | median | best (used) |",
        "|---|---|---|---|",
        f"| memory read GB/s | {min(reads):.1f} | {statistics.median(reads):.1f} | {max(reads):.1f} |",
        f"| bf16 1024^3 matmul GFLOP/s | {min(rates):.0f} | {statistics.median(rates):.0f} | "
        f"{max(rates):.0f} |",
        f"| weight-bandwidth floor at N=1 ({cost.weight_bytes / 1e6:.1f} MB of bf16 weights), tok/s | | | "
        f"{floors.bandwidth_tok_s(cost, 1):.0f} |",
        f"| compute floor ({cost.decode_flops_per_token() / 1e6:.1f} MFLOP per token), tok/s | | | "
        f"{floors.compute_tok_s(cost):.0f} |",
    ]
    sections["decode_tokens"], ratios["decode_tokens"] = _decode_table(
        decode, TOKEN_ENGINES, sizes, floors, cost
    )
    sections["decode_embeds"], ratios["decode_embeds"] = _decode_table(
        decode, EMBED_ENGINES, sizes, floors, cost
    )
    ratios["decode_embeds"]["tandem-embeds/tandem"] = {
        n: _ratio(_median(decode.get("tandem-embeds"), n), _median(decode.get("tandem"), n)) for n in sizes
    }

    ttft = payload["ttft_s"]
    lines = ["| prompt tokens | Tandem ms | transformers ms | Tandem / transformers (speed) | "
             "compute floor ms | Tandem / floor |", "|---|---|---|---|---|---|"]  # fmt: skip
    for length in settings["ttft_lens"]:
        tandem = _median(ttft.get("tandem"), length)
        hf = _median(ttft.get("transformers"), length)
        floor_s = floors.prefill_s(cost, length)
        ratios.setdefault("ttft", {})[length] = _ratio(hf, tandem)
        lines.append(
            f"| {length} | {_fmt(tandem and 1e3 * tandem)} | {_fmt(hf and 1e3 * hf)} | "
            f"{_fmt(_ratio(hf, tandem), '.2f', 'x')} | {1e3 * floor_s:.1f} | "
            f"{_fmt(_ratio(floor_s, tandem) and 100 * _ratio(floor_s, tandem), '.1f', '%')} |"
        )
    sections["ttft"] = lines

    prefix = payload["prefix_cache_ttft_s"]
    miss, hit = prefix["miss"]["median"], prefix["hit"]["median"]
    ratios["prefix_cache_speedup"] = miss / hit
    sections["prefix_cache"] = [
        f"| {settings['prefix_len']}-token prompt | TTFT ms |",
        "|---|---|",
        f"| miss (fresh prompt) | {1e3 * miss:.1f} |",
        f"| hit (same prompt again) | {1e3 * hit:.1f} |",
        f"| miss / hit | {miss / hit:.1f}x |",
    ]

    transport = payload["transport"]
    lines = ["| rows x 512 bf16 | MB | encode MB/s | serialize + parse MB/s | decode MB/s | Embed RPC MB/s | "
             "Embed RPC ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for rows, codec in transport["codec_mb_per_s"].items():
        rpc = transport["embed_rpc"][rows]
        lines.append(
            f"| {rows} | {codec['megabytes']:.2f} | {codec['encode']:.0f} | {codec['serialize_parse']:.0f} | "
            f"{codec['decode']:.0f} | {rpc['mb_per_s']:.0f} | {rpc['median_ms']:.2f} |"
        )
    sections["transport"] = lines

    for name, lines in sections.items():
        print(f"\n## {name}\n")
        print("\n".join(lines))
    return {"tables": sections, "ratios": ratios, "floors_used": floors.as_dict()}


def write_plot(payload: dict, path: Path) -> None:
    """Two panels: tokens/s against concurrency per engine; TTFT against prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    settings, decode = payload["settings"], payload["decode_tok_s"]
    sizes, cost = settings["sizes"], ModelCost(**settings["cost"])
    floors = best([Floors(**f) for f in payload["floors"]])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for engines, style in ((TOKEN_ENGINES, "-o"), (EMBED_ENGINES, "--s")):
        for key, label in engines:
            points = [(n, _median(decode.get(key), n)) for n in sizes]
            points = [(n, r) for n, r in points if r is not None]
            if points:
                suffix = " (embedding prompts)" if engines is EMBED_ENGINES else ""
                color = COLORS[label]
                left.plot(*zip(*points, strict=True), style, color=color, label=label + suffix)
    left.plot(sizes, [floors.decode_tok_s(cost, n) for n in sizes], ":k", label="floor (measured)")
    title = f"Decode throughput ({settings['prompt_len']} prompt + {settings['new_tokens']} new tokens)"
    left.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="tokens/s", title=title)
    left.legend(fontsize=7)
    for key, label in (("tandem", "Tandem"), ("transformers", "transformers")):
        entry = payload["ttft_s"].get(key)
        if entry:
            lens = settings["ttft_lens"]
            right.plot(lens, [1e3 * _median(entry, n) for n in lens], "-o", color=COLORS[label], label=label)
    hit = payload["prefix_cache_ttft_s"]["hit"]["median"]
    right.plot([settings["prefix_len"]], [1e3 * hit], "*", color=COLORS["Tandem"], markersize=12,
               label="Tandem, prefix-cache hit")  # fmt: skip
    right.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT ms",
              title="Time to first token (one request)")  # fmt: skip
    right.legend(fontsize=7)
    for axis in (left.xaxis, left.yaxis, right.xaxis, right.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    left.set_xticks(sizes, [str(n) for n in sizes])
    right.set_xticks(settings["ttft_lens"], [str(n) for n in settings["ttft_lens"]])
    fig.suptitle(f"bench-small bf16, {payload['machine']['cpus']} CPUs, {payload['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
