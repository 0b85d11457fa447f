"""`ember` command line: generate text, fetch the model, run benchmarks."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import ember  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)


def engine_flags() -> list[str]:
    """Every engine setting is a flag of `ember generate` / `ember bench`, by the same name."""
    from ember.engine.config import EngineSettings
    return list(EngineSettings.model_fields)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, made from ember.engine.config.EngineSettings: the YAML's names and defaults."""
    import types
    import typing

    from ember.engine.config import EngineSettings
    from ember.model.fetch import DEFAULT_MODEL_PATH
    p.add_argument("--model", default=str(DEFAULT_MODEL_PATH), help="GGUF file or HF model folder")
    for name in engine_flags():
        field = EngineSettings.model_fields[name]
        flag, help_text = "--" + name.replace("_", "-"), f"{field.description} (default: {field.default})"
        kinds = [a for a in (typing.get_args(field.annotation) or (field.annotation,)) if a is not type(None)]
        if field.annotation is bool:
            p.add_argument(flag, default=field.default, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        listed = field.annotation  # list[int] or list[int] | None: one or more values
        if typing.get_origin(listed) in (typing.Union, types.UnionType):
            listed = next(a for a in typing.get_args(listed) if a is not type(None))
        if typing.get_origin(listed) is list:
            p.add_argument(flag, default=field.default, nargs="+", type=typing.get_args(listed)[0], help=help_text)
            continue
        if typing.get_origin(field.annotation) is typing.Literal:
            choices, kind = kinds, str
        else:
            choices, kind = None, kinds[0]  # int or float (X | None: X)
        p.add_argument(flag, default=field.default, choices=choices, type=kind, help=help_text)


def engine_settings(args) -> dict:
    return {name: getattr(args, name) for name in engine_flags()}


def _problems(e: ValueError) -> str:
    """An error's text on one line: a settings validation error's problems only, without pydantic's
    layout and links."""
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return str(e)
    return "; ".join(item["msg"].removeprefix("Value error, ") for item in errors())


def cmd_generate(args) -> int:
    if args.router:
        return _generate_remote(args)
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.errors import CapacityError
    from ember.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(EngineConfig(model=args.model, **engine_settings(args)))
    except ValueError as e:
        print(f"error: {_problems(e)}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    try:
        engine.add_request(prompt, params)
    except (ValueError, CapacityError) as e:
        print(f"error: {e}", file=sys.stderr)
        engine.close()
        return 2
    try:
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
                    print(f"[{out.finish_reason}: {out.prompt_tokens} prompt, {out.cached_tokens} cached, "
                          f"{out.completion_tokens} completion tokens]", file=sys.stderr)
    finally:
        engine.close()
    return 0


def _generate_remote(args) -> int:
    import os

    import grpc

    from ember.client import RouterClient
    kwargs = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"text": args.prompt}
    ca = args.ca or os.environ.get("EMBER_ROUTER_CA") or None
    try:
        client = RouterClient(args.router, api_key=args.api_key or os.environ.get("EMBER_API_KEY"), ca=ca)
    except OSError as e:
        print(f"error: --ca: cannot read {ca}: {e.strerror or e}", file=sys.stderr)
        return 2
    with client:
        try:
            for msg in client.stream(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                     top_k=args.top_k, seed=args.seed, stop=args.stop, **kwargs):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finished:
                    sys.stdout.write("\n")
                    u, t, p = msg.usage, msg.timings, msg.placement
                    print(f"[{msg.finish_reason}: {u.prompt_tokens} prompt, {u.cached_tokens} cached, "
                          f"{u.completion_tokens} completion tokens; ttft {t.ttft_s * 1000:.0f} ms, "
                          f"transfer {t.transfer_s * 1000:.0f} ms, tpot {t.tpot_s * 1000:.1f} ms; "
                          f"prefill@{p.prefill_site} decode@{p.decode_site}; cached blocks per site: "
                          f"{', '.join(f'{k} {v}' for k, v in sorted(p.cached_blocks.items())) or 'unknown'}]",
                          file=sys.stderr)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    return 0


def cmd_up(args) -> int:
    from ember.cluster.launcher import default_run_dir, up
    run_dir = Path(args.run_dir or default_run_dir()).resolve()
    try:
        config = up(args.config, run_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("ember cluster up")
    from ember.cluster.launcher import router_ca
    ca = router_ca(config, run_dir)
    print(f"  gRPC (ember.v1.Router):  {config.router.listen}" + (" (TLS)" if ca else ""))
    scheme = "https" if ca else "http"
    print("  OpenAI HTTP API:         " + (f"{scheme}://{config.router.http}/v1" if config.router.http else
                                            "off (set router.http in the config)"))
    if ca:
        print(f"  clients trust this CA:   {ca}  (ember generate --ca FILE or EMBER_ROUTER_CA; "
              "openai: http_client=openai.DefaultHttpxClient(verify=FILE); curl --cacert FILE)")
    print(f"  run directory:           {run_dir}  (logs, traces; `ember down` stops it)")
    tls = {"auto": f"mTLS, certificates made in {run_dir / 'certs'}", "files": "mTLS, mounted certificates",
           "plaintext": "PLAINTEXT (security.tls: plaintext)"}[config.security.tls]
    print(f"  internal hops:           {tls}")
    if config.router.require_api_key or config.router.api_keys_file or os.environ.get("EMBER_API_KEY"):
        print("  API key:                 required (Authorization: Bearer KEY; ember generate --api-key)")
    return 0


def cmd_down(args) -> int:
    from ember.cluster.launcher import down
    stopped = down(args.run_dir)
    print(f"stopped {len(stopped)} processes" if stopped else "nothing running")
    return 0


def cmd_serve(args) -> int:
    """Run one service in this process, as `python -m ember.services.ROLE` would."""
    import runpy
    sys.argv = [f"ember serve {args.role}", *args.rest]
    runpy.run_module(f"ember.services.{args.role}", run_name="__main__", alter_sys=True)
    return 0


def cmd_fetch_model(args) -> int:
    from ember.model.fetch import MODELS, fetch_model
    from ember.model.files import prepare_gguf
    if args.name not in MODELS:
        print(f"error: unknown model {args.name!r}; named models: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    path = fetch_model(args.name, Path(args.dest) if args.dest else None)
    prepare_gguf(path)
    print(path)
    return 0


def cmd_status(args) -> int:
    from ember.cluster.launcher import default_run_dir
    from ember.cluster.status import render
    run_dir = Path(args.run_dir or default_run_dir())
    if not (run_dir / "services.json").exists():
        print(f"no cluster in {run_dir} (start one with `ember up`)", file=sys.stderr)
        return 1
    print(render(run_dir))
    return 0


def cmd_trace(args) -> int:
    from ember.cluster.launcher import default_run_dir
    from ember.cluster.traces import render_request
    run_dir = Path(args.run_dir or default_run_dir())
    if not run_dir.is_dir():
        print(f"no run directory {run_dir} (start a cluster with `ember up`, or name one with --run-dir)",
              file=sys.stderr)
        return 1
    try:
        print(render_request(run_dir, args.request_id, all_attributes=args.all))
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _folder_uid(value: str) -> tuple[str, int]:
    folder, _, uid = value.partition("=")
    if not folder or "/" in folder or not uid.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not FOLDER=UID (e.g. redis=999)")
    return folder, int(uid)


def cmd_certs(args) -> int:
    """A CA and every service's certificate folder for a cluster config (ember.cluster.certs).
    Idempotent: a folder that already holds a CA is left as is unless --force (a Compose one-shot
    job reruns on every `up`)."""
    from ember.cluster import redis_files
    from ember.cluster.certs import CertificateAuthority, write_cluster_certs
    from ember.config.load import load_config
    from ember.config.services import services
    out = Path(args.out)
    try:
        config = load_config(args.config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = [s.name for s in services(config)] + ["operator"]
    if (out / "ca.crt").exists() and not args.force:
        missing = [n for n in names if not (out / n / "tls.crt").is_file()]
        if redis_files.needed(config) and not (out / redis_files.FOLDER / "users.acl").is_file():
            missing.append(redis_files.FOLDER)
        if missing:
            print(f"error: {out} has a CA but no certificate for {', '.join(missing)}; rerun with --force to "
                  "make a new CA and every certificate (then restart every service)", file=sys.stderr)
            return 1
        print(f"{out}: certificates exist, left as is (--force makes a new CA and every certificate)")
        return 0
    missing = [f for f, _ in args.chown if f not in (*names, redis_files.FOLDER)]
    if missing:
        print(f"error: --chown {', '.join(missing)}: not a folder `ember certs` writes for this config",
              file=sys.stderr)
        return 2
    write_cluster_certs(config, out, args.days)
    try:  # directory.url a Redis: its certificate, its ACL users' file and each role's password
        redis = redis_files.write_redis_files(config, out, CertificateAuthority.load(out))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for folder, uid in args.chown:  # a container that mounts the folder runs as its own user
        for f in [out / folder, *(out / folder).iterdir()]:
            os.chown(f, uid, uid)
    print(f"{out}: a new CA and certificates for {', '.join(names)}, valid {args.days} days"
          + (f"; Redis's certificate and ACL users in {redis}" if redis is not None else ""))
    if config.security.tls == "plaintext":
        print(f"note: {args.config} says `security: {{tls: plaintext}}`, so its services will not use them")
    return 0


BENCHES = {"engine": "engine_bench", "disagg": "disagg_bench", "kv": "kv_bench", "agentic": "agentic_bench",
           "quality": "quality", "budget": "budget_bench", "served": "served_bench",
           "simulate": "sim_bench", "placement": "placement_bench", "chaos": "chaos", "overload": "overload",
           "tenants": "tenants_bench",
           "security": "security_bench", "constrained": "constrained_bench",
           "speculative": "speculative_bench", "decode": "decode_bench", "parallel": "parallel_bench",
           "gpu": "gpu_bench", "link": "link_bench", "streaming": "stream_bench", "moe": "moe_bench",
           "jumpforward": "jumpforward_bench", "tools": "tools_bench", "weights": "weights_bench",
           "startup": "startup_bench", "tls": "tls_bench"}


def cmd_bench(args) -> int:
    import importlib
    args.output = args.output or f"bench-out/{args.what}.json"
    return importlib.import_module(f"ember.bench.{BENCHES[args.what]}").main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="Ember: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion from the in-process engine")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--router", help="HOST:PORT of a running router; default: an in-process engine")
    g.add_argument("--api-key", help="the router's API key (with --router; default: $EMBER_API_KEY)")
    g.add_argument("--ca", help="with --router: TLS to the router, trusting this CA file (router.tls; `ember up` "
                                "prints it; default: $EMBER_ROUTER_CA, else plaintext)")
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    run_dir_help = "logs, pids and traces (default: $EMBER_STATE_DIR/runs/local or ~/.local/state/ember/runs/local)"
    u = sub.add_parser("up", help="start the local cluster (router, prefill, decode, kvstores)")
    u.add_argument("--config", help="cluster YAML (default: the shipped local cluster, configs/local.yaml)")
    u.add_argument("--run-dir", help=run_dir_help)
    u.set_defaults(func=cmd_up)
    st = sub.add_parser("status", help="health, load and KV usage of each service of the local cluster")
    st.add_argument("--run-dir", help=run_dir_help)
    st.set_defaults(func=cmd_status)
    d = sub.add_parser("down", help="stop the local cluster")
    d.add_argument("--run-dir", help=run_dir_help)
    d.set_defaults(func=cmd_down)
    sv = sub.add_parser("serve", help="run one service of a cluster config: ember serve ROLE --config FILE "
                                      "[--site SITE]", add_help=False)
    sv.add_argument("role", choices=["router", "prefill", "decode", "kvstore"])
    sv.add_argument("rest", nargs=argparse.REMAINDER, help="the service's flags (ember serve ROLE --help)")
    sv.set_defaults(func=cmd_serve)

    f = sub.add_parser("fetch-model", help="download, verify and convert a named model (into the user cache)")
    f.add_argument("name", nargs="?", default="SmolLM2-135M-Instruct.Q4_1", help="named model (default: %(default)s)")
    f.add_argument("--dest", help="GGUF path to write (default: the user cache, $EMBER_CACHE_DIR/models or "
                                  "~/.cache/ember/models)")
    f.set_defaults(func=cmd_fetch_model)

    c = sub.add_parser("certs", help="write a cluster CA and one certificate folder per service of a config "
                                     "(for `security: {tls: files}`)")
    c.add_argument("--config", required=True, help="cluster YAML")
    c.add_argument("--out", required=True, help="folder: OUT/ca.crt, ca.key, OUT/<service>/ca.crt, tls.crt, tls.key "
                                                "(+ kv-mac.key for prefill and decode), OUT/operator/")
    c.add_argument("--force", action="store_true", help="replace existing certificates (a new CA)")
    c.add_argument("--days", type=int, default=365, help="validity of the CA and certificates (default: %(default)s; "
                                                         "rotate with --force before then)")
    c.add_argument("--chown", action="append", default=[], type=_folder_uid, metavar="FOLDER=UID",
                   help="give OUT/FOLDER to this uid (and gid): the user a container mounting it runs as (redis=999 "
                        "for the redis image, operator=65534 for Prometheus'); repeatable")
    c.set_defaults(func=cmd_certs)

    b = sub.add_parser("bench", help="benchmarks that write JSON")
    b.add_argument("what", choices=list(BENCHES))
    b.add_argument("--output", "--out", default=None, help="JSON path (default bench-out/WHAT.json)")
    b.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    b.add_argument("--systems", help="agentic: comma-separated subset of llama-server,transformers,"
                                     "ember-colocated,ember-disagg (default: all)")
    b.add_argument("--cluster-config", help="agentic, overload: the cluster YAML to run (default: the shipped "
                                            "configs/local.yaml; chaos: configs/local-ha.yaml), laid onto free ports")
    b.add_argument("--phases", help="agentic: comma-separated subset of replay,streams16,single_stream (default: all)")
    b.add_argument("--arrival-rate", type=float, default=0.0,
                   help="agentic: sessions arrive as a Poisson process of this rate (1/s); 0 = all at once")
    b.add_argument("--slo-ttft", type=float, default=5.0, help="agentic: TTFT SLO (s) for goodput")
    b.add_argument("--slo-tpot", type=float, default=0.2, help="agentic: time-per-output-token SLO (s) for goodput")
    b.add_argument("--scenarios", help="chaos: comma-separated subset of decode_kill,prefill_kill,kvstore_kill,"
                                       "blackhole (default: all)")
    b.add_argument("--stall-timeout-s", type=float, default=2.0,
                   help="chaos: router.stall_timeout_s of the blackhole scenario's cluster (shipped default: 30)")
    b.add_argument("--max-inflight", type=int, default=None, help="overload: router.max_inflight (default: 8); "
                                                                  "tenants: (default: the config's)")
    b.add_argument("--clients", type=int, default=None, help="overload: concurrent streams (default: 80); tenants: "
                                                             "tenant A's burst (default: 64)")
    b.add_argument("--write-profile", help="placement: write the calibration cluster's config, with this "
                                           "machine's measured hardware profile, to this YAML")
    b.add_argument("--like", help="gpu: a folder with the config and tokenizer a random-weights --model is made "
                                  "in the shape of, when --model does not exist (default: the default model's)")
    _add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    from ember.placement.cli import add_commands
    add_commands(sub)
    # `ember trace REQUEST_ID`: one request's spans; `ember trace --config --output` (ember.placement.cli's)
    # writes an agentic workload trace
    tr = sub.choices["trace"]
    tr.add_argument("request_id", nargs="?", metavar="REQUEST_ID",
                    help="print this request's spans as a tree (its final message's request_id), from the "
                         "local cluster's run directory")
    tr.add_argument("--run-dir", help=run_dir_help)
    tr.add_argument("--all", action="store_true",
                    help="REQUEST_ID: every attribute of each span, not only the key ones")
    workload = tr.get_default("func")
    tr.set_defaults(func=lambda args: cmd_trace(args) if args.request_id else workload(args))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
