#!/usr/bin/env python3
"""Checks docker-compose.yml without a Docker engine (there is no `docker compose` here).

What it proves: the file is valid YAML (anchors and merge keys resolved as Compose resolves
them), every service uses only keys of the Compose specification this file needs, ports and
dependencies are well formed, and the project's own rules hold:
- one image, built once: exactly one service has `build`, and every service running the relay
  image names the same `image`;
- the relay has a healthcheck;
- interpolated variables (`${X:-default}`) are compose-only and never look like relay settings
  (no `OUTBOX_` or `VALKEY_` prefix), and each has a default;
- every `depends_on` names a service, with a condition Compose knows.
What it does not prove: the full Compose schema, image availability, or that containers start.
tests/docs.rs checks the relay's environment against the CLI.

Usage: scripts/check-compose.py [docker-compose.yml]
"""

import re
import sys

try:
    import yaml
except ImportError:
    sys.exit("check-compose: python3-yaml is missing (apt-get install python3-yaml)")

SERVICE_KEYS = {
    "build", "image", "command", "entrypoint", "environment", "ports", "volumes",
    "depends_on", "healthcheck", "restart", "stop_grace_period", "pull_policy", "user",
}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "disable"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
PORT = re.compile(r"^(127\.0\.0\.1:)?(\$\{[A-Z0-9_]+:-\d+\}|\d+):\d+$")
INTERPOLATION = re.compile(r"\$\{([A-Za-z0-9_]+)(:-[^}]*)?\}")


def main(path: str) -> int:
    text = open(path, encoding="utf-8").read()
    doc = yaml.safe_load(text)
    problems = []
    services = doc.get("services") or {}
    if not services:
        problems.append("no services")
    builders = [n for n, s in services.items() if "build" in s]
    if len(builders) != 1:
        problems.append(f"exactly one service should build the image, found {builders}")
    built_image = services[builders[0]].get("image") if len(builders) == 1 else None
    if not built_image:
        problems.append("the building service must name its image, for the others to reuse")
    for name, svc in services.items():
        for key in svc:
            if key not in SERVICE_KEYS:
                problems.append(f"{name}: unexpected key {key!r}")
        if "build" not in svc and "image" not in svc:
            problems.append(f"{name}: neither build nor image")
        if svc.get("image") == built_image and "build" not in svc and svc.get("pull_policy") != "never":
            problems.append(f"{name}: runs the locally built image: set pull_policy: never")
        for port in svc.get("ports", []):
            if not PORT.match(str(port)):
                problems.append(f"{name}: port {port!r} is not host:container on loopback")
        deps = svc.get("depends_on", {})
        for dep, spec in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            if dep not in services:
                problems.append(f"{name}: depends on unknown service {dep!r}")
            cond = (spec or {}).get("condition", "service_started")
            if cond not in CONDITIONS:
                problems.append(f"{name}: unknown condition {cond!r}")
        hc = svc.get("healthcheck")
        if hc is not None:
            for key in hc:
                if key not in HEALTHCHECK_KEYS:
                    problems.append(f"{name}: unexpected healthcheck key {key!r}")
            test = hc.get("test")
            if not (isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL")):
                problems.append(f"{name}: healthcheck test must be a CMD or CMD-SHELL list")
    relay = services.get("relay")
    if relay is None:
        problems.append("no relay service")
    else:
        if "healthcheck" not in relay:
            problems.append("relay: no healthcheck")
        if relay.get("image") != built_image:
            problems.append("relay: must run the image the file builds")
    # Only real interpolations: `$$` is a literal dollar.
    for match in INTERPOLATION.finditer(text.replace("$$", "")):
        var, default = match.group(1), match.group(2)
        if var.startswith(("OUTBOX_", "VALKEY_")):
            problems.append(f"${{{var}}}: a compose variable must not look like a relay setting")
        if not default:
            problems.append(f"${{{var}}}: give it a default (${{{var}:-...}})")
    for p in problems:
        print(f"check-compose: {path}: {p}", file=sys.stderr)
    if not problems:
        print(f"check-compose: {path}: ok ({len(services)} services)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docker-compose.yml"))
