#!/usr/bin/env python3
"""Fuzzes every REST route from the OpenAPI document with schemathesis.

Starts `avm serve --dev` on free ports with its own data directory, runs
schemathesis over the document `avm openapi` prints (every operation, the
operator admin's key on every request), stops the server and fails when:

- any answer is a 5xx (`not_a_server_error`): no client input may make the
  server fail;
- any 4xx or 5xx answer is not the API's error document, JSON
  `{"error":{"code","message","requestId"}}` with a SCREAMING_SNAKE_CASE code
  (`error_document`, defined below);
- the server panicked or exited during the run.

Before fuzzing it makes one of each thing a route names by id (a container,
an image with a running agent, a tenant and its users, a key, a resource, a
credential), and schemathesis uses those ids half of the time, so requests
reach the services' logic and not only NOT_FOUND. Deletes run last. One
case in ten has a path parameter whose bytes are not UTF-8 (`%ff`), which
schemathesis never generates by itself (it found the plain-text 400 of
`GET /v1/containers/%ff/images` that way).

The CI profile (the default) is bounded: 40 examples per operation, a
minute or two on two cores. `--long` fuzzes for `--max-time` seconds (default 30
minutes) with up to 1000 examples per operation. Failures are printed by
schemathesis with a curl command that reproduces each.

Needs `pip install schemathesis` (CI pins the version) and a built `avm`
binary (`cargo build -p avm`).

This file is also the schemathesis hooks module that registers the
`error_document` check (loaded through SCHEMATHESIS_HOOKS).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request

try:
    import schemathesis
    from hypothesis import strategies
except ImportError:
    sys.exit("needs schemathesis: pip install schemathesis==4.32.5")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE = re.compile(r"^[A-Z][A-Z0-9_]*$")


@schemathesis.check
def error_document(ctx, response, case):
    """Fails unless a 4xx or 5xx answer is the API's JSON error document."""
    # An answer to HEAD has no body by definition.
    if response.status_code < 400 or case.method.upper() == "HEAD":
        return None
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if not content_type.startswith("application/json"):
        raise AssertionError(
            f"{response.status_code} answered with content type {content_type!r}, not JSON: {response.text[:200]!r}"
        )
    try:
        body = json.loads(response.text)
    except ValueError as err:
        raise AssertionError(f"{response.status_code} answered with a body that is not JSON: {err}") from None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        raise AssertionError(f"{response.status_code} answered without an `error` object: {response.text[:200]!r}")
    code = error.get("code")
    if not isinstance(code, str) or not CODE.match(code):
        raise AssertionError(f"{response.status_code} answered with error code {code!r}, not SCREAMING_SNAKE_CASE")
    for field in ("message", "requestId"):
        if not isinstance(error.get(field), str) or not error[field]:
            raise AssertionError(f"{response.status_code} error document has no `{field}`: {response.text[:200]!r}")
    return None


# Percent-escapes of bytes that are not UTF-8: schemathesis encodes every
# path parameter it generates as UTF-8, so it never sends these by itself.
NOT_UTF8 = ["%ff", "%c3%28", "%80", "a%fe%fd", "%ed%a0%80"]


@schemathesis.hook
def flatmap_case(context, case):
    """Sends one in ten cases with a path parameter that is not UTF-8 once decoded."""
    names = sorted(case.path_parameters or {})
    if not names:
        return strategies.just(case)

    def corrupt(choice):
        gate, name, raw = choice
        if gate == 0:
            case.path_parameters = {**case.path_parameters, name: raw}
        return case

    return strategies.tuples(
        strategies.integers(0, 9), strategies.sampled_from(names), strategies.sampled_from(NOT_UTF8)
    ).map(corrupt)


def start_server(avm: pathlib.Path, data_dir: pathlib.Path, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """Starts `avm serve --dev` and returns it with its gateway URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AVM_", "LLM_"))}
    env.update(
        {
            "AVM_LOG_LEVEL": "warn",
            # The fuzzer sends far more than a person would: no per-minute limit.
            "AVM_AUTH_DEFAULT_REQUESTS_PER_MINUTE": "0",
            "LLM_PROVIDER": "offline",
        }
    )
    args = [str(avm), "serve", "--dev", "--port", "0", "--grpc-port", "0", "--data-dir", str(data_dir)]
    stderr = log.open("w")
    server = subprocess.Popen(
        args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        # Reads the `listening:` lines, then keeps draining so the server never blocks on stdout.
        for line in server.stdout:
            if line.startswith("listening: gateway ") and not found:
                found.append(line.split()[2])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60) or not found:
        server.kill()
        sys.exit(f"avm serve did not start:\n{log.read_text()[-4000:]}")
    return server, found[0]


def call(url: str, key: str, method: str, path: str, body: dict | None = None) -> dict:
    """Calls the API as the operator admin; returns the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        raise SystemExit(f"seeding: {method} {path} answered {err.code}: {err.read()[:500]!r}") from None


def seed(url: str, key: str) -> dict[str, list[str]]:
    """Makes one of each thing a route names by id; returns the ids by kind."""
    call(url, key, "POST", "/v1/containers", {"containerId": "fuzz"})
    image = call(url, key, "POST", "/v1/containers/fuzz/images", {"name": "fuzz"})["imageId"]
    agent = call(url, key, "POST", f"/v1/images/{image}/run")["agentId"]
    tenant = call(url, key, "POST", "/v1/tenants", {"name": "fuzz", "adminName": "fuzz admin"})
    tenant_id = tenant["tenant"]["tenantId"]
    user = call(url, key, "POST", f"/v1/tenants/{tenant_id}/users", {"name": "fuzz member"})
    # Keys of the operator's tenant the fuzzer may revoke: never the one it uses.
    api_key = call(url, key, "POST", "/v1/auth/keys", {"name": "fuzz"})["key"]["keyId"]
    resource = call(
        url, key, "POST", "/v1/resources",
        {"kind": "prompt", "name": "fuzz", "version": "1.0.0", "content": {"template": "hello {{name}}", "variables": [{"name": "name", "default": "you"}]}},
    )["resource"]["resourceId"]
    call(url, key, "PUT", "/v1/credentials/fuzz", {"bearerToken": "fuzz-token", "url": "https://mcp.example.com/mcp"})
    return {
        "containers": ["fuzz"],
        "images": [image],
        "agents": [agent],
        "tenants": [tenant_id],
        "users": [user["userId"], tenant["admin"]["userId"]],
        "keys": [api_key],
        "resources": [resource],
        "servers": ["fuzz"],
        "settings": ["llm.model", "defaults.maxTokens", "runtime.agentIdleTimeout"],
    }


def fuzz_config(ids: dict[str, list[str]], path: pathlib.Path) -> None:
    """Writes a schemathesis configuration that uses the seeded ids half the
    time, so operations reach their service's logic and not only NOT_FOUND."""
    bind = lambda name: f'{{ dictionary = "{name}", probability = 0.5 }}'  # noqa: E731
    lines = []
    for name, values in ids.items():
        lines += [f"[dictionaries.{name}]", f"values = {json.dumps(values)}", ""]
    operations = [
        ("^/v1/containers/", {"path.id": "containers", "path.user": "users"}),
        ("^/v1/images/", {"path.id": "images"}),
        ("^/v1/agents", {"path.id": "agents", "query.containerId": "containers"}),
        ("^/v1/tenants/", {"path.id": "tenants", "path.user": "users"}),
        ("^/v1/auth/keys", {"path.id": "keys", "query.userId": "users"}),
        ("^/v1/resources/", {"path.id": "resources"}),
        ("^/v1/credentials/", {"path.server": "servers"}),
        ("^/v1/config/", {"path.key": "settings"}),
    ]
    for regex, parameters in operations:
        lines += ["[[operations]]", f"include-path-regex = {json.dumps(regex)}"]
        lines += [f'parameters = {{ {", ".join(f"{json.dumps(k)} = {bind(v)}" for k, v in parameters.items())} }}', ""]
    # An event stream stays open for as long as the client reads it:
    # schemathesis reads one event, or for two seconds.
    lines += [
        "[[operations]]",
        'include-path-regex = "/events$"',
        "request-timeout = 2",
        "max-stream-events = 1",
        "",
    ]
    path.write_text("\n".join(lines))


def stop_server(server: subprocess.Popen) -> int | None:
    """Stops the server with SIGTERM; returns its exit code (None if it had to be killed)."""
    if server.poll() is not None:
        return server.returncode
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    parser.add_argument("--avm", type=pathlib.Path, default=target / "debug" / "avm", help="the avm binary")
    parser.add_argument("--schema", type=pathlib.Path, help="the OpenAPI document (default: what `avm openapi` prints)")
    parser.add_argument("--long", action="store_true", help="fuzz for --max-time seconds with many more examples")
    parser.add_argument("--max-time", type=int, default=1800, help="time budget of --long, in seconds")
    parser.add_argument("--seed", type=int, help="schemathesis seed, to repeat a run")
    parser.add_argument("--workers", default="2", help="concurrent schemathesis workers")
    parser.add_argument("extra", nargs="*", help="more schemathesis options, after `--`")
    args = parser.parse_args()
    if not args.avm.exists():
        sys.exit(f"no avm binary at {args.avm}: run `cargo build -p avm` first")

    work = pathlib.Path(tempfile.mkdtemp(prefix="avm-api-fuzz-"))
    try:
        schema = args.schema.resolve() if args.schema else None
        if schema is None:
            schema = work / "openapi.json"
            schema.write_text(subprocess.run([str(args.avm), "openapi"], check=True, capture_output=True, text=True).stdout)
        data_dir = work / "data"
        data_dir.mkdir(mode=0o700)
        log = work / "avm.log"
        server, url = start_server(args.avm, data_dir, log)
        code = 1
        try:
            admin_key = (data_dir / "admin.key").read_text().strip()
            config = work / "schemathesis.toml"
            fuzz_config(seed(url, admin_key), config)
            command = [
                sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", str(schema),
                "--url", url,
                "--header", f"Authorization: Bearer {admin_key}",
                "--checks", "not_a_server_error,error_document",
                # Every operation runs on its own: the stateful phase would
                # chain deletes of the operator's own tenant and keys.
                "--phases", "examples,coverage,fuzzing",
                "--workers", args.workers,
                "--request-timeout", "20",
                "--generation-database", "none",
                "--no-color",
                "--suppress-health-check", "all",
            ]
            command += ["--max-examples", "1000" if args.long else "40"]
            if args.seed is not None:
                command += ["--seed", str(args.seed)]
            command += args.extra
            env = dict(os.environ, SCHEMATHESIS_HOOKS=str(pathlib.Path(__file__).resolve()))
            # Deletes run last, on their own: a delete that finds its target
            # (schemathesis reuses ids from earlier answers) would take it
            # from every operation after it.
            passes = [["--exclude-method", "DELETE"], ["--include-method", "DELETE"]]
            if args.long:
                passes[0] += ["--max-time", str(max(1, args.max_time * 9 // 10))]
                passes[1] += ["--max-time", str(max(1, args.max_time // 10))]
            # In the scratch directory: schemathesis keeps state in its working directory.
            codes = [subprocess.run(command + selection, env=env, cwd=work, check=False).returncode for selection in passes]
            code = next((c for c in codes if c != 0), 0)
            if server.poll() is not None:
                print(f"avm serve exited during the run with {server.returncode}", file=sys.stderr)
                code = code or 1
        finally:
            exit_code = stop_server(server)
        logs = log.read_text()
        if "panicked" in logs:
            print("avm serve panicked:", file=sys.stderr)
            print("\n".join(line for line in logs.splitlines() if "panicked" in line)[:4000], file=sys.stderr)
            code = code or 1
        if exit_code != 0:
            print(f"avm serve did not stop cleanly (exit {exit_code}):\n{logs[-4000:]}", file=sys.stderr)
            code = code or 1
        return code
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
