"""The harness's tables (markdown, printed and kept in the JSON) and its plot, per model.

Ratios are Tandem / peer in speed: tokens/s over tokens/s, and for times the peer's time over
Tandem's, so above 1 always means Tandem is faster. "Floor" is the lower of the weight-bandwidth
and compute bounds, from the best floor sample of the same run (`floors.py`); the fraction is
measured / floor for speeds and floor / measured for times. Decode-only rates count the tokens after
each request's first over the time from the last first token to the end: the decode steps alone,
which is what the weight-bandwidth floor bounds.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from floors import Floors, ModelCost, best

# (engine key in the JSON, label); the first of each group is Tandem's in-process engine.
TOKEN_ENGINES = (("tandem", "Tandem"), ("tandem-grpc", "Tandem gRPC"), ("transformers", "transformers"),
                 ("vllm", "vLLM CPU"), ("llama.cpp", "llama.cpp Q4_1"))  # fmt: skip
EMBED_ENGINES = (("tandem-embeds", "Tandem"), ("transformers-embeds", "transformers"),
                 ("vllm-embeds", "vLLM CPU"))  # fmt: skip
COLORS = {"Tandem": "C0", "Tandem gRPC": "C1", "transformers": "C2", "vLLM CPU": "C3", "llama.cpp Q4_1": "C4"}


def _median(entry: dict | str | None, key: int) -> float | None:
    if not isinstance(entry, dict):
        return None
    row = entry.get(key) or entry.get(str(key))
    return row["median"] if row else None


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def with_llama(section: dict) -> tuple[dict, dict]:
    """The model's decode and decode-only rates, llama.cpp's batch-1 rows (or why it has none) added."""
    decode, decode_only = dict(section["decode_tok_s"]), dict(section.get("decode_only_tok_s", {}))
    llama = section.get("llama_cpp")
    if isinstance(llama, dict):
        decode["llama.cpp"] = {1: {"median": llama["decode"]["tokens_per_s"]}}
        decode_only["llama.cpp"] = {1: {"median": llama["decode"]["decode_tokens_per_s"]}}
    elif llama is not None:
        decode["llama.cpp"] = llama
    return decode, decode_only


def _decode_table(
    decode: dict, decode_only: dict, engines: tuple, sizes: list[int], floors: Floors, cost: ModelCost
) -> tuple[list[str], dict]:
    """One row per N: tokens/s of every engine that ran (decode-only in brackets), ratios, the floor."""
    ran = [(key, label) for key, label in engines if not isinstance(decode.get(key), str)]
    (base, base_label), peers = ran[0], ran[1:]
    header = ["N", *(f"{label} tok/s" for _, label in ran)]
    header += [f"{base_label} / {label}" for _, label in peers]
    header += ["floor tok/s", f"{base_label} / floor", f"{base_label} decoding / floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios: dict = {}
    for n in sizes:
        rates = {key: _median(decode.get(key), n) for key, _ in ran}
        floor = floors.decode_tok_s(cost, n)
        row = [str(n)]
        for key, _ in ran:
            only = _median(decode_only.get(key), n)
            row.append(_fmt(rates[key]) + (f" ({only:.1f})" if only is not None else ""))
        for key, _ in peers:
            ratio = _ratio(rates[base], rates[key])
            ratios.setdefault(f"{base}/{key}", {})[n] = ratio
            row.append(_fmt(ratio, ".2f", "x"))
        fraction = _ratio(rates[base], floor)
        decoding = _ratio(_median(decode_only.get(base), n), floor)
        ratios.setdefault(f"{base}/floor", {})[n] = fraction
        ratios.setdefault(f"{base}-decoding/floor", {})[n] = decoding
        row += [f"{floor:.0f}", _fmt(fraction and 100 * fraction, ".1f", "%")]
        row.append(_fmt(decoding and 100 * decoding, ".1f", "%"))
        lines.append("| " + " | ".join(row) + " |")
    skipped = [f"{label}: {decode[key]}" for key, label in engines if isinstance(decode.get(key), str)]
    return lines + ([f"\n{'; '.join(skipped)}"] if skipped else []), ratios


def _ttft_table(section: dict, lens: list[int], floors: Floors, cost: ModelCost) -> tuple[list[str], dict]:
    ttft, llama = section["ttft_s"], section.get("llama_cpp")
    llama_ttft = llama["ttft_s"] if isinstance(llama, dict) else None
    header = ["prompt tokens", "Tandem ms", "transformers ms", "llama.cpp Q4_1 ms", "Tandem / transformers",
              "Tandem / llama.cpp", "compute floor ms", "Tandem / floor"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios: dict = {}
    for length in lens:
        tandem, hf = _median(ttft.get("tandem"), length), _median(ttft.get("transformers"), length)
        peer = _median(llama_ttft, length)
        floor_s = floors.prefill_s(cost, length)
        ratios.setdefault("tandem/transformers", {})[length] = _ratio(hf, tandem)
        ratios.setdefault("tandem/llama.cpp", {})[length] = _ratio(peer, tandem)
        ratios.setdefault("tandem/floor", {})[length] = _ratio(floor_s, tandem)
        ms = [_fmt(v and 1e3 * v) for v in (tandem, hf, peer)]
        lines.append(
            f"| {length} | {' | '.join(ms)} | {_fmt(_ratio(hf, tandem), '.2f', 'x')} | "
            f"{_fmt(_ratio(peer, tandem), '.2f', 'x')} | {1e3 * floor_s:.1f} | "
            f"{_fmt(_ratio(floor_s, tandem) and 100 * _ratio(floor_s, tandem), '.1f', '%')} |"
        )
    return lines, ratios


def quantized_table(quantized: dict, sizes: list[int]) -> tuple[list[str], dict]:
    """tokens/s (decode-only in brackets) of the GGUF file's own weights against bf16, and memory."""
    tok, only, rss = quantized["decode_tok_s"], quantized["decode_only_tok_s"], quantized["rss_mb"]
    lines = ["| N | bf16 tok/s | gguf tok/s | gguf / bf16 |", "|---|---|---|---|"]
    ratios: dict = {}
    for n in sizes:
        dense, quant = _median(tok.get("tandem"), n), _median(tok.get("tandem-gguf"), n)
        dense_only, quant_only = _median(only.get("tandem"), n), _median(only.get("tandem-gguf"), n)
        ratios[n] = _ratio(quant, dense)
        lines.append(
            f"| {n} | {_fmt(dense)} ({_fmt(dense_only)}) | {_fmt(quant)} ({_fmt(quant_only)}) | "
            f"{_fmt(ratios[n], '.2f', 'x')} |"
        )
    lines.append(f"| resident MB | {rss['tandem']:.0f} | {rss['tandem-gguf']:.0f} | "
                 f"{rss['tandem-gguf'] - rss['tandem']:+.0f} MB |")  # fmt: skip
    return lines, ratios


def activations_table(
    quantized: dict, activations: dict, llama: dict | str | None, sizes: list[int]
) -> tuple[list[str], dict]:
    """tokens/s (decode-only in brackets) of the gguf weights with 8-bit activations against bf16 and
    the exact gguf engine (interleaved with both), and at N = 1 against llama.cpp decoding (goals:
    >= 1.2x bf16 at N = 32, >= 1.3x llama.cpp at N = 1, decoding)."""
    engine = "tandem-gguf-int8"
    tok = quantized["decode_tok_s"] | activations["decode_tok_s"]
    only = quantized["decode_only_tok_s"] | activations["decode_only_tok_s"]
    lines = [
        "| N | int8 activations tok/s | / bf16 | / gguf | decoding / bf16 | decoding / gguf |",
        "|---|---|---|---|---|---|",
    ]
    ratios: dict = {}
    for n in sizes:
        ours, ours_only = _median(tok.get(engine), n), _median(only.get(engine), n)
        cells = [_fmt(ours) + f" ({_fmt(ours_only)})"]
        for rates, mine in ((tok, ours), (only, ours_only)):
            for other in ("tandem", "tandem-gguf"):
                ratio = _ratio(mine, _median(rates.get(other), n))
                ratios[f"{n}:{'decoding' if rates is only else 'end to end'}/{other}"] = ratio
                cells.append(_fmt(ratio, ".2f", "x"))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if isinstance(llama, dict):
        ours, theirs = _median(only.get(engine), 1), llama["decode"]["decode_tokens_per_s"]
        ratios["1:decoding/llama.cpp"] = _ratio(ours, theirs)
        lines.append(f"| 1, decoding against llama.cpp ({_fmt(theirs)} tok/s) | {_fmt(ours)} | "
                     f"{_fmt(ratios['1:decoding/llama.cpp'], '.2f', 'x')} | | | |")  # fmt: skip
    lines.append(f"| resident MB | {activations['rss_mb'][engine]:.0f} | | | | |")
    return lines, ratios


def llama_table(quantized: dict, llama: dict | str | None, lens: list[int]) -> tuple[list[str], dict]:
    """Batch 1 on the same GGUF file: Tandem --quantization gguf against llama.cpp (goal: decode
    >= 1.2x, end to end >= 1.5x)."""
    if not isinstance(llama, dict):
        return [f"llama.cpp: {llama or 'did not run'}"], {}
    note = "" if llama.get("extra_bufts", True) else " (repacked buffers off: the default run crashed)"
    rows = [
        ("decode only, tok/s", _median(quantized["decode_only_tok_s"].get("tandem-gguf"), 1),
         llama["decode"]["decode_tokens_per_s"], False),
        ("end to end, tok/s", _median(quantized["decode_tok_s"].get("tandem-gguf"), 1),
         llama["decode"]["tokens_per_s"], False),
    ] + [
        (f"time to first token, {n} tokens, ms", _median(quantized.get("ttft_s"), n),
         _median(llama["ttft_s"], n), True)
        for n in lens
    ]  # fmt: skip
    lines = [f"| N = 1 | Tandem gguf | llama.cpp{note} | Tandem / llama.cpp |", "|---|---|---|---|"]
    ratios: dict = {}
    for label, ours, theirs, is_time in rows:
        ratio = _ratio(theirs, ours) if is_time else _ratio(ours, theirs)  # > 1: Tandem ahead
        ratios[label] = ratio
        scale = 1e3 if is_time else 1
        lines.append(
            f"| {label} | {_fmt(ours and scale * ours)} | {_fmt(theirs and scale * theirs)} | "
            f"{_fmt(ratio, '.2f', 'x')} |"
        )
    return lines, ratios


def _model_sections(label: str, section: dict, settings: dict, floors: Floors) -> tuple[dict, dict]:
    cost, sizes = ModelCost(**section["settings"]["cost"]), settings["sizes"]
    decode, decode_only = with_llama(section)
    sections: dict[str, list[str]] = {}
    ratios: dict = {}
    sections[f"{label}: decode, token prompts (decode-only rates in brackets)"], ratios["decode_tokens"] = (
        _decode_table(decode, decode_only, TOKEN_ENGINES, sizes, floors, cost)
    )
    sections[f"{label}: decode, embedding prompts"], ratios["decode_embeds"] = _decode_table(
        decode, decode_only, EMBED_ENGINES, sizes, floors, cost
    )
    sections[f"{label}: time to first token"], ratios["ttft"] = _ttft_table(
        section, settings["ttft_lens"], floors, cost
    )
    if section.get("quantized"):
        sections[f"{label}: --quantization gguf against bf16 weights"], ratios["quantized"] = quantized_table(
            section["quantized"], sizes
        )
        sections[f"{label}: --quantization gguf against llama.cpp on the same file"], ratios["llama_cpp"] = (
            llama_table(section["quantized"], section.get("llama_cpp"), settings["ttft_lens"])
        )
    if section.get("quantized") and section.get("quantized-activations"):
        title = f"{label}: --quantization gguf --quantized-activations int8 (quantized-activations)"
        sections[title], ratios["quantized-activations"] = activations_table(
            section["quantized"], section["quantized-activations"], section.get("llama_cpp"), sizes
        )
    prefix = section["prefix_cache_ttft_s"]
    miss, hit = prefix["miss"]["median"], prefix["hit"]["median"]
    ratios["prefix_cache_speedup"] = miss / hit
    sections[f"{label}: prefix cache"] = [
        f"| {settings['prefix_len']}-token prompt | TTFT ms |", "|---|---|",
        f"| miss (fresh prompt) | {1e3 * miss:.1f} |", f"| hit (same prompt again) | {1e3 * hit:.1f} |",
        f"| miss / hit | {miss / hit:.1f}x |",
    ]  # fmt: skip
    return sections, ratios


def print_report(payload: dict) -> dict:
    """Print the tables; return them (markdown lines) and every ratio, for the JSON."""
    settings = payload["settings"]
    samples = [Floors(**f) for f in payload["floors"]]
    floors = best(samples)
    reads = [f.read_gb_per_s for f in samples]
    rates = [f.matmul_bf16_gflops for f in samples]
    rates32 = [f.matmul_fp32_gflops for f in samples]
    sections: dict[str, list[str]] = {
        "floors": [
            f"| measure ({len(samples)} samples in the run) | lowest | median | best (used) |",
            "|---|---|---|---|",
            f"| memory read GB/s | {min(reads):.1f} | {statistics.median(reads):.1f} | {max(reads):.1f} |",
            f"| bf16 1024^3 matmul GFLOP/s | {min(rates):.0f} | {statistics.median(rates):.0f} | "
            f"{max(rates):.0f} |",
            f"| fp32 1024^3 matmul GFLOP/s | {min(rates32):.0f} | {statistics.median(rates32):.0f} | "
            f"{max(rates32):.0f} |",
            f"| matmul rate bounding compute (the faster dtype), GFLOP/s | | | {floors.matmul_gflops:.0f} |",
        ]
    }
    ratios: dict = {}
    for label, section in payload["models"].items():
        cost = ModelCost(**section["settings"]["cost"])
        sections["floors"] += [
            f"| {label}: weight-bandwidth floor at N=1 ({cost.weight_bytes / 1e6:.1f} MB of bf16 weights), "
            f"tok/s | | | {floors.bandwidth_tok_s(cost, 1):.0f} |",
            f"| {label}: compute floor ({cost.decode_flops_per_token() / 1e6:.1f} MFLOP per token), tok/s "
            f"| | | {floors.compute_tok_s(cost):.0f} |",
        ]
        model_sections, ratios[label] = _model_sections(label, section, settings, floors)
        sections |= model_sections
    transport = payload["transport"]
    header = ["rows x hidden bf16", "MB", "encode MB/s", "serialize + parse MB/s", "decode MB/s",
              "Embed RPC MB/s", "Embed RPC ms"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
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
    """Per model, two panels: tokens/s against concurrency per engine; TTFT against prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    settings, models = payload["settings"], payload["models"]
    sizes, lens = settings["sizes"], settings["ttft_lens"]
    floors = best([Floors(**f) for f in payload["floors"]])
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.8 * len(models)), squeeze=False)
    for (label, section), (left, right) in zip(models.items(), axes, strict=True):
        cost = ModelCost(**section["settings"]["cost"])
        decode, _ = with_llama(section)
        for engines, style in ((TOKEN_ENGINES, "-o"), (EMBED_ENGINES, "--s")):
            for key, name in engines:
                points = [(n, r) for n in sizes if (r := _median(decode.get(key), n)) is not None]
                if points:
                    suffix = " (embedding prompts)" if engines is EMBED_ENGINES else ""
                    left.plot(*zip(*points, strict=True), style, color=COLORS[name], label=name + suffix)
        left.plot(sizes, [floors.decode_tok_s(cost, n) for n in sizes], ":k", label="floor (measured)")
        title = f"{label}: decode ({settings['prompt_len']} + {settings['new_tokens']} tokens)"
        left.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="tokens/s", title=title)
        llama = section.get("llama_cpp")
        ttft = dict(section["ttft_s"]) | ({"llama.cpp": llama["ttft_s"]} if isinstance(llama, dict) else {})
        for key, name in (
            ("tandem", "Tandem"),
            ("transformers", "transformers"),
            ("llama.cpp", "llama.cpp Q4_1"),
        ):
            if ttft.get(key):
                right.plot(
                    lens, [1e3 * _median(ttft[key], n) for n in lens], "-o", color=COLORS[name], label=name
                )
        hit = section["prefix_cache_ttft_s"]["hit"]["median"]
        right.plot([settings["prefix_len"]], [1e3 * hit], "*", color=COLORS["Tandem"], markersize=12,
                   label="Tandem, prefix-cache hit")  # fmt: skip
        right.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT ms",
                  title=f"{label}: time to first token (one request)")  # fmt: skip
        for axis in (left.xaxis, left.yaxis, right.xaxis, right.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        left.set_xticks(sizes, [str(n) for n in sizes])
        right.set_xticks(lens, [str(n) for n in lens])
        left.legend(fontsize=7)
        right.legend(fontsize=7)
    fig.suptitle(f"bf16, {payload['machine']['cpus']} CPUs, {payload['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
