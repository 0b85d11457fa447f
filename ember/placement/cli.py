"""`ember config check|example`, `ember trace`, `ember simulate`, `ember plan [memory]` (torch-free)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import yaml

POLICIES = ["central", "edge", "ember"]


def cmd_config(args) -> int:
    from ember.placement.examples import topology
    if args.action == "example":
        yaml.safe_dump(topology(args.edges, args.central), sys.stdout, sort_keys=False)
        return 0
    from ember.config.explain import render
    from ember.config.load import load_config
    path = args.file
    if path is None:
        from ember.cluster.launcher import default_config
        path = default_config()
    try:
        config = load_config(path)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# {path}: valid. Every setting, its value and where it came from:")
    print(render(config, path))
    print()
    print(topology_table(config))
    return 0


def topology_table(config) -> str:
    rows = [("site", "tier", "roles", "hardware", "decode cap", "prefill tok/s")]
    for s in config.sites:
        rows.append((s.name, s.tier, ",".join(s.roles), s.hardware, str(config.decode_capacity(s.name)),
                     f"{config.profile(s.name).prefill_tokens_per_s:g}"))
    lines = _table(rows)
    lines.append(f"\n{len(config.links)} links, policy {config.placement.policy!r}, router at {config.router.site}")
    if config.regions:
        region_rows = [("user region", "nearest decode sites (RTT ms)")]
        for r in config.regions:
            near = sorted((x.rtt_ms, x.site) for x in r.reach if config.site(x.site).has("decode"))[:3]
            region_rows.append((r.name, ", ".join(f"{s} {rtt:g}" for rtt, s in near)))
        lines += [""] + _table(region_rows)
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def cmd_trace(args) -> int:
    if not (args.config and args.output):
        print("error: ember trace needs a REQUEST_ID (its spans), or --config and --output (an agentic "
              "workload trace)", file=sys.stderr)
        return 2
    from ember.config.load import load_config
    from ember.placement import trace
    from ember.placement.examples import region_weights
    config = load_config(args.config)
    regions = [r.name for r in config.regions]
    if not regions:
        print("error: the config has no `regions` to draw users from", file=sys.stderr)
        return 2
    requests = trace.agentic(regions, region_weights(len(regions)), sessions_per_s=args.sessions_per_s,
                             duration_s=args.duration_s, seed=args.seed)
    trace.write(requests, args.output)
    print(f"{len(requests)} requests in {len({r.session for r in requests})} sessions -> {args.output}")
    return 0


def cmd_simulate(args) -> int:
    from ember.config.load import load_config
    from ember.placement import trace
    from ember.placement.simulate import Simulator
    config = load_config(args.config)
    requests = list(trace.read(args.trace))
    policies = POLICIES if args.policy == "all" else [args.policy]
    reports = [Simulator(config, p, args.slo_ttft, args.slo_tpot).run(requests) for p in policies]
    rows = [("policy", "TTFT p50/p90/p99 s", "TTFT p95", "TPOT p50/p99 ms", "e2e p50/p99 s", "goodput rps",
             "SLO met", "link GB", "remote", "sim s")]
    for r in reports:
        rows.append((r.policy, f"{r.ttft['p50']:.3f}/{r.ttft['p90']:.3f}/{r.ttft['p99']:.3f}", f"{r.ttft['p95']:.3f}",
                     f"{r.tpot['p50'] * 1e3:.0f}/{r.tpot['p99'] * 1e3:.0f}", f"{r.e2e['p50']:.2f}/{r.e2e['p99']:.2f}",
                     f"{r.goodput_rps:.2f}", f"{r.slo_attainment:.1%}", f"{r.link_bytes / 1e9:.1f}",
                     f"{r.remote_prefill_fraction:.0%}", f"{r.wall_s:.1f}"))
    print(f"{len(requests)} requests, SLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot * 1e3:.0f} ms")
    print("\n".join(_table(rows)))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps([r.as_dict() for r in reports], indent=2))
    return 0


def cmd_plan(args) -> int:
    if args.what == "memory":
        return cmd_plan_memory(args)
    missing = [flag for flag, value in (("--config", args.config), ("--trace", args.trace)) if value is None]
    if missing:
        print(f"error: ember plan (workers) needs {' and '.join(missing)}", file=sys.stderr)
        return 2
    from ember.config.load import load_config
    from ember.placement import trace
    from ember.placement.plan import Planner, sized
    config = load_config(args.config)
    requests = list(trace.read(args.trace))
    planner = Planner(config, requests, args.slo_ttft, args.slo_tpot, args.share, args.policy, args.max_workers)
    plan = planner.plan()
    r = plan.report
    print(f"{len(requests)} requests; SLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot * 1e3:.0f} ms for "
          f">= {args.share:.0%} of them; policy {args.policy}; {plan.simulations} simulations")
    if not plan.met:
        print(f"no plan: even {args.max_workers} workers for every site and role meet the SLO for only "
              f"{r.slo_attainment:.1%} (the sites' links or RTTs bound it; add sites or relax the SLO)")
        return 1
    rows = [("site", "tier", "prefill workers", "decode workers", "decode capacity")]
    sizes = sized(config, plan.counts)
    for s in sizes.sites:
        rows.append((s.name, s.tier, str(plan.counts.get((s.name, "prefill"), "-")),
                     str(plan.counts.get((s.name, "decode"), "-")),
                     str(sizes.decode_capacity(s.name)) if s.has("decode") else "-"))
    print("\n".join(_table(rows)))
    print(f"\n{plan.workers()} workers: SLO met by {r.slo_attainment:.1%}, goodput {r.goodput_rps:.2f} req/s, "
          f"TTFT p50/p95 {r.ttft['p50']:.3f}/{r.ttft['p95']:.3f} s, TPOT p50 {r.tpot['p50'] * 1e3:.0f} ms")
    if plan.smaller:
        print("one worker fewer misses: " + ", ".join(f"{site} {role} {a:.1%}" for (site, role), a in plan.smaller))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({
            "share": plan.share, "simulations": plan.simulations, "workers": plan.workers(),
            "counts": [{"site": site, "role": role, "workers": n} for (site, role), n in plan.counts.items()],
            "report": r.as_dict(),
            "one_fewer": [{"site": site, "role": role, "slo_attainment": a} for (site, role), a in plan.smaller],
        }, indent=2))
    if args.write_config:
        Path(args.write_config).write_text(yaml.safe_dump(sizes.model_dump(mode="json", exclude_none=True),
                                                          sort_keys=False))
    return 0


def cmd_plan_memory(args) -> int:
    """`ember plan memory`: per weight dtype, every TP/PP/EP layout's weights, workspace and KV per rank
    and the context that fits beside them (ember.placement.memory_plan), the best layout's arithmetic
    term by term, then a verdict."""
    from ember.engine import workspace as ws
    from ember.placement import memory_plan as mp
    missing = [flag for flag, value in (("--model-config", args.model_config), ("--hardware", args.hardware))
               if value is None]
    if missing:
        print(f"error: ember plan memory needs {' and '.join(missing)}", file=sys.stderr)
        return 2
    try:
        shape = mp.read_model_shape(args.model_config)
        hardware = mp.parse_hardware(args.hardware)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not 0 < args.memory_fraction <= 1 or (args.reserve_gib is not None and args.reserve_gib < 0) \
            or min(args.max_batched_tokens, args.max_seqs, args.sequences) < 1:
        print("error: --memory-fraction must be in (0, 1], --reserve-gib >= 0, --max-batched-tokens, --max-seqs "
              "and --sequences >= 1", file=sys.stderr)
        return 2
    limits = ws.StepLimits(args.max_batched_tokens, args.max_seqs, cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64))
    budget = mp.Budget(args.memory_fraction, None if args.reserve_gib is None else args.reserve_gib * mp.GIB,
                       args.kv_dtype, limits=limits, sequences=args.sequences)
    dtypes = list(mp.WEIGHT_DTYPES) if args.dtype == "all" else [args.dtype]
    print("\n".join(_memory_header(shape, hardware, budget, args.model_config)))
    report = {"model_config": str(args.model_config), "model_type": shape.model_type, "hardware": str(hardware),
              "gpu_memory_mib": hardware.memory_mib, "memory_fraction": budget.memory_fraction,
              "reserve_bytes": budget.reserve_bytes, "kv_dtype": budget.kv_dtype,
              "runtime_terms": [{"name": t.name, "bytes": t.nbytes} for t in budget.runtime(hardware)],
              "max_num_batched_tokens": limits.max_num_batched_tokens, "max_num_seqs": limits.max_num_seqs,
              "min_context_tokens": budget.min_context_tokens, "parameters": shape.parameter_counts(),
              "total_parameters": shape.total_parameters, "active_parameters": shape.active_parameters,
              "kv_bytes_per_token": shape.kv_bytes_per_token(budget.kv_dtype), "dtypes": []}
    for dtype in dtypes:
        plans = mp.plan_memory(shape, hardware, dtype, budget)
        smallest = mp.smallest_fit(shape, hardware.gpu, dtype, budget)
        print()
        print("\n".join(_memory_table(shape, hardware, dtype, plans, smallest, budget)))
        report["dtypes"].append({"dtype": dtype, "note": mp.WEIGHT_DTYPES[dtype].note,
                                 "layouts": [p.as_dict() for p in plans],
                                 "smallest_fit": None if smallest is None else
                                 {"gpus": smallest[0], **smallest[1].as_dict()}})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:,.2f} GiB"


def _memory_header(shape, hardware, budget, source) -> list[str]:
    from ember.placement.memory_plan import KV_DTYPE_BYTES
    parts = ", ".join(f"{name.replace('_', ' ')} " + (f"{n / 1e9:.2f} B" if n >= 1e7 else f"{n / 1e6:.2f} M")
                      for name, n in shape.parameter_counts().items() if n)
    kv_values = shape.kv_values_per_token_layer()
    kv_kind = ("one MLA latent plane, whole on every TP rank" if shape.attention == "MLA"
               else f"K and V of {shape.num_kv_heads} KV heads, split by TP up to {shape.num_kv_heads}")
    usable = budget.usable_bytes(hardware)
    fraction = "" if budget.memory_fraction == 1 else f" x {budget.memory_fraction:.2f} (--memory-fraction)"
    lines = [f"{Path(source).name}: {shape.model_type} ({shape.attention}), {len(shape.layers)} layers, "
             f"{shape.total_parameters / 1e9:,.1f} B parameters ({shape.active_parameters / 1e9:.1f} B active); "
             f"vision towers not counted",
             f"  {parts}",
             f"KV per token ({budget.kv_dtype}): {kv_values} values x {len(shape.layers)} layers x "
             f"{KV_DTYPE_BYTES[budget.kv_dtype]} B = {shape.kv_bytes_per_token(budget.kv_dtype):,} B ({kv_kind})",
             f"{hardware}: {hardware.count} x {hardware.memory_mib:,} MiB as CUDA reports it{fraction} = "
             f"{_gib(usable)} a GPU"]
    runtime = budget.runtime(hardware)
    if runtime:
        lines.append("  runtime a GPU: " + " + ".join(f"{t.name} {_gib(t.nbytes)}" for t in runtime)
                     + f" = {_gib(sum(t.nbytes for t in runtime))}")
        lines.append(f"  workspace: the step at max_num_batched_tokens {budget.limits.max_num_batched_tokens:,}, "
                     f"max_num_seqs {budget.limits.max_num_seqs} (bf16 activations, paged attention kernels), "
                     f"per layout below; a layout fits when >= {budget.min_context_tokens:,} context tokens do")
    else:
        lines.append(f"  less a flat {budget.reserve_bytes / 2 ** 30:g} GiB reserve (--reserve-gib) for runtime and "
                     f"workspace; a layout fits when >= {budget.min_context_tokens:,} context tokens do")
    return lines


def _memory_table(shape, hardware, dtype, plans, smallest, budget) -> list[str]:
    from ember.engine import workspace as ws
    from ember.placement import memory_plan as mp
    chunked = shape.chunk_size is not None
    head = ("layout", "weights/rank GB", "workspace GiB", "KV GiB/rank", "KV GiB node", "KV B/token/rank",
            "context tokens") + ((f"hybrid, {budget.sequences} seqs",) if chunked else ())
    rows = [head]
    for p in plans:
        tokens = f"{p.context_tokens:,}" if p.fits else f"- ({p.reason})"
        extra = (f"{p.hybrid_tokens:,}" if p.hybrid_tokens is not None else "-",) if chunked else ()
        rows.append((str(p.layout), f"{p.weight_bytes / 1e9:.1f}", f"{p.workspace_bytes / 2 ** 30:.2f}",
                     f"{p.kv_pool_bytes / 2 ** 30:.2f}", f"{p.kv_node_bytes / 2 ** 30:.1f}",
                     f"{p.kv_bytes_per_token:,}", tokens) + extra)
    total = mp.total_weight_bytes(shape, dtype)
    lines = [f"== {dtype}: {mp.WEIGHT_DTYPES[dtype].note}; {total / 1e9:,.1f} GB of weights in all"] + _table(rows)
    fitting = [p for p in plans if p.fits]
    top = mp.best(plans)
    lines.append(f"verdict: fits {hardware} in {len(fitting)} of {len(plans)} layouts; most context {top.layout} "
                 f"({top.context_tokens:,} tokens, {top.kv_node_bytes / 2 ** 30:.1f} GiB of KV over the node)"
                 if top else f"verdict: no layout fits {hardware}")
    budgeted = (f"{smallest[0]} ({smallest[1].layout}, {smallest[1].context_tokens:,} context tokens)" if smallest
                else f"more than {mp.GPU_COUNTS_SEARCHED[-1]}")
    lines.append(f"  fewest {hardware.gpu}: the weights alone need {mp.gpus_for_weights(shape, hardware.gpu, dtype)} "
                 f"({total / 1e9:,.1f} GB); within the budget above, {budgeted}")
    shown = top or min(plans, key=lambda p: p.weight_bytes + p.workspace_bytes)
    lines.append(f"  {shown.layout}, the tightest rank: {_gib(shown.capacity_bytes)} - runtime "
                 f"{_gib(shown.runtime_bytes)} - weights {_gib(shown.tightest_weight_bytes)} - workspace "
                 f"{_gib(shown.workspace_bytes)} = KV pool "
                 f"{_gib(shown.kv_pool_bytes)}; / {shown.kv_bytes_per_token:,} B a token = {shown.context_tokens:,} "
                 f"context tokens")
    if shown.workspace is not None:
        lines.append("  workspace of that rank's step:")
        lines += ["  " + line for line in ws.describe(shown.workspace)]
        torch_recipes = _torch_attention_extra(shape, shown, budget)
        if torch_recipes:
            lines.append(torch_recipes)
    if chunked and shown.hybrid_tokens is not None:
        local = sum(layer.chunked for layer in shape.layers)
        per_layer = shown.kv_bytes_per_token // len(shape.layers) if shown.layout.pp == 1 else None
        lines.append(f"  hybrid KV: the {local} chunked-attention layers keep, per running sequence, its current "
                     f"{shape.chunk_size:,}-token chunk (+ one step's {budget.limits.max_num_batched_tokens:,} tokens "
                     f"crossing into the next): {_gib(shown.chunk_window_bytes)} for {budget.sequences} sequences; the "
                     f"{len(shape.layers) - local} full layers hold the context: ({_gib(shown.kv_pool_bytes)} - "
                     f"{_gib(shown.chunk_window_bytes)}) / {(len(shape.layers) - local) * per_layer:,} B a token = "
                     f"{shown.hybrid_tokens:,} context tokens" if per_layer else
                     f"  hybrid KV: {shown.hybrid_tokens:,} context tokens over {budget.sequences} sequences")
        counts = [1, 8, 32, 64]
        others = [(n, mp.plan_layout(shape, hardware, shown.layout, dtype, replace(budget, sequences=n)).hybrid_tokens)
                  for n in counts]
        lines.append("  hybrid context tokens by concurrent sequences: "
                     + ", ".join(f"{n}: {t:,}" for n, t in others if t is not None))
    return lines


def _torch_attention_extra(shape, plan, budget, context: int = 32768) -> str | None:
    """What the workspace would grow by if prefill ran Ember's torch attention recipes (SDPA with a
    mask, as its CUDA prefill does today) instead of the paged kernels the plan assumes."""
    from ember.engine import workspace as ws
    if budget.reserve_bytes is not None or shape.step is None:
        return None
    paged = replace(budget.limits, tp=plan.layout.tp, ep=plan.layout.ep, activation_bytes=2)
    torch_limits = replace(paged, attention="torch", context_tokens=context, chunked=shape.chunk_size is not None)
    extra = ws.step_workspace(shape.step, torch_limits).peak_bytes - ws.step_workspace(shape.step, paged).peak_bytes
    why = "SDPA's math path holds the scores, heads x tokens x context" if shape.attention == "MLA" else \
        "the context gather and its mask, tokens x context"
    return (f"  (the plan assumes paged attention kernels (FlashAttention / FlashMLA, as Infire and vLLM run); "
            f"Ember's torch recipes, which its CUDA prefill runs today, would add {_gib(extra)} a GPU at a "
            f"{paged.max_num_batched_tokens:,}-token chunk against a {context:,}-token context: {why})")


def add_commands(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="check an edge-placement config, or print an example")
    c.add_argument("action", choices=["check", "example"])
    c.add_argument("file", nargs="?", help="config YAML (check; default: the shipped local cluster)")
    c.add_argument("--edges", type=int, default=12, help="example: edge sites")
    c.add_argument("--central", type=int, default=3, help="example: central GPU regions")
    c.set_defaults(func=cmd_config)

    t = sub.add_parser("trace", help="`ember trace REQUEST_ID`: one request's spans as a tree (ember.cli); "
                                     "`ember trace --config C --output O`: generate an agentic trace (JSON lines) "
                                     "over a config's user regions")
    t.add_argument("--config", help="the workload's config (with --output)")
    t.add_argument("--output", help="the workload trace to write (with --config)")
    t.add_argument("--sessions-per-s", type=float, default=2.0)
    t.add_argument("--duration-s", type=float, default=1800.0)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_trace)

    s = sub.add_parser("simulate", help="simulate a trace through the placement policies")
    s.add_argument("--config", required=True)
    s.add_argument("--trace", required=True)
    s.add_argument("--policy", default="all", choices=POLICIES + ["all"])
    s.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT target, seconds")
    s.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT target, seconds")
    s.add_argument("--output", help="JSON report")
    s.set_defaults(func=cmd_simulate)

    p = sub.add_parser("plan", help="size prefill and decode workers per site for a trace and SLOs (simulated); "
                                     "`plan memory`: weights, KV and context per GPU of a model's layouts")
    p.add_argument("what", nargs="?", choices=["workers", "memory"], default="workers",
                   help="workers (default: --config, --trace) or memory (--model-config, --hardware)")
    p.add_argument("--config", help="workers: the sites, links, regions and hardware profiles")
    p.add_argument("--trace", help="workers: JSON lines (ember trace)")
    p.add_argument("--model-config", help="memory: a Hugging Face config.json (or a folder holding one)")
    p.add_argument("--hardware", help="memory: <GPU>x<count>, e.g. H100x8, H200x2 (GPU: H100, H200, A100, L40S, B200)")
    p.add_argument("--dtype", default="all", choices=["bf16", "fp8", "int4", "all"], help="memory: weight dtype")
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"], help="memory: KV cache dtype")
    p.add_argument("--memory-fraction", type=float, default=1.0,
                   help="memory: share of each GPU's memory (as CUDA reports it) to use")
    p.add_argument("--reserve-gib", type=float, default=None,
                   help="memory: a flat GiB reserve a GPU keeps in place of the runtime and workspace model")
    p.add_argument("--max-batched-tokens", type=int, default=1024,
                   help="memory: the engine's max_num_batched_tokens (the step the workspace is sized for)")
    p.add_argument("--max-seqs", type=int, default=64, help="memory: the engine's max_num_seqs (logits rows)")
    p.add_argument("--sequences", type=int, default=8,
                   help="memory: concurrent sequences the hybrid-KV context (chunked attention) is stated for")
    p.add_argument("--json", help="memory: write the plan as JSON")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT target, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT target, seconds")
    p.add_argument("--share", type=float, default=0.95, help="fraction of requests that must meet both targets")
    p.add_argument("--policy", default="ember", choices=POLICIES)
    p.add_argument("--max-workers", type=int, default=64, help="ceiling per site and role")
    p.add_argument("--output", help="JSON plan")
    p.add_argument("--write-config", help="the config with the planned workers, as YAML")
    p.set_defaults(func=cmd_plan)


def main_for_tests(argv: list[str]) -> int:
    """Run one of these commands as `ember` would (tests call this without a subprocess)."""
    parser = argparse.ArgumentParser(prog="ember")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
