"""`ember config check|example`, `ember trace`, `ember simulate`, `ember plan` (torch-free)."""
from __future__ import annotations

import argparse
import json
import sys
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


def add_commands(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="check an edge-placement config, or print an example")
    c.add_argument("action", choices=["check", "example"])
    c.add_argument("file", nargs="?", help="config YAML (check; default: the shipped local cluster)")
    c.add_argument("--edges", type=int, default=12, help="example: edge sites")
    c.add_argument("--central", type=int, default=3, help="example: central GPU regions")
    c.set_defaults(func=cmd_config)

    t = sub.add_parser("trace", help="generate an agentic trace (JSON lines) over a config's user regions")
    t.add_argument("--config", required=True)
    t.add_argument("--output", required=True)
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

    p = sub.add_parser("plan", help="size prefill and decode workers per site for a trace and SLOs (simulated)")
    p.add_argument("--config", required=True, help="the sites, links, regions and hardware profiles")
    p.add_argument("--trace", required=True, help="JSON lines (ember trace)")
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
