"""The host side of the preflight: one interpreter start on a server host tells what the engine installed
for that interpreter makes of an arm. Standard library only: it runs as `python -c <this file's source>`
under the host's own python (the host need not have heisenhunt installed), reads one JSON request from
argv[1] and prints one JSON answer on its last line.

Request: {"parser": "module:attr" (sglang's `ServerArgs.add_cli_args`, or a parser-building function),
"registry": null (the host's sglang: its env registry, then its source) or "module:attr" (an iterable of
the env names an engine reads, e.g. the simulator's), "argvs": [[flags...], ...], "env": [names],
"backends": bool (check that each PD argv's transfer backend imports), "list_known": bool (answer every
name the engine reads as "env_known")}. A request without "parser" asks only what ran where: the
answer's first three fields.

Answer: {"sglang": version or null, "hostname": str, "python": the interpreter's version, "parser":
"ok" | "absent", "parser_detail": str, "argvs": [verdict per argv], "env": {name: {"read_in": "registry" |
"deprecated" | a source path | "", "nearest": [names]}},
"env_scanned": what was searched, "backends": {name: {"module": str, "error": str}}}. A verdict is
{"status": "ok" | "refused", "detail": str, "abbreviated": {word: [full flags]}, "deprecated": [flags],
"parsed": {flag: [dest, value]}}: what each given flag set in the parser's namespace, so the running
server's own view of its arguments can be compared with it after start-up.

Why a source scan after the registry: sglang reads many variables with `os.environ.get("SGLANG_...")`
outside `sglang.srt.environ` (e.g. SGLANG_HEALTH_CHECK_TIMEOUT in 0.5.23), and it never warns about a
variable nobody reads. A name found in neither is set for nothing.
"""

import argparse
import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

# the modules each transfer backend imports when its KV manager starts (sglang/srt/disaggregation, 0.5.23)
BACKEND_MODULES = {
    "mooncake": "mooncake.engine",
    "mooncake_tcp": "mooncake.engine",
    "nixl": "nixl._api",
    "mori": "mori.io",
    "ascend": "memfabric_hybrid",
    "fake": "",
}
ENGINE_NAME = re.compile(r"\b(SGLANG?_[A-Z0-9_]+)\b")


class Refused(Exception):
    pass


def load(target):
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def build_parser(target):
    obj = load(target)
    try:
        takes_parser = len(inspect.signature(obj).parameters) > 0
    except (TypeError, ValueError):
        takes_parser = True
    if takes_parser:
        parser = argparse.ArgumentParser(prog="sglang")
        obj(parser)
    else:
        parser = obj()

    def refuse(message):
        raise Refused(message)

    parser.error = refuse  # argparse reports through error(); exit would lose the message
    return parser


def plain(value):
    """A JSON value for a parsed argument (enums and paths as their string)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(getattr(value, "value", value))


def judge_flags(parser, flags):
    known = parser._option_string_actions
    try:
        namespace = parser.parse_args(flags)
    except Refused as e:
        return {"status": "refused", "detail": str(e)}, None
    abbreviated, deprecated, parsed = {}, [], {}
    for word in flags:
        name = word.split("=", 1)[0]
        if not name.startswith("--") or name == "--":
            continue
        if name not in known:
            # argparse silently takes a unique prefix for the full flag: a renamed flag would slip through
            abbreviated[name] = sorted(o for o in known if o.startswith(name))
            continue
        action = known[name]
        if "deprecated" in type(action).__name__.lower():
            deprecated.append(name)
        parsed[name] = [action.dest, plain(getattr(namespace, action.dest, None))]
    verdict = {"status": "ok", "abbreviated": abbreviated, "deprecated": deprecated, "parsed": parsed}
    return verdict, namespace


def sglang_version():
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def sglang_env_names():
    """(registry names, deprecated names, {name: first source file}, what was searched) of the installed
    sglang."""
    environ = importlib.import_module("sglang.srt.environ")
    field = environ.EnvField
    registry = {name for name, value in vars(environ.Envs).items() if isinstance(value, field)}
    deprecated = set(getattr(environ, "_DEPRECATED_ENVS", {}))
    root = os.path.dirname(os.path.dirname(os.path.abspath(environ.__file__)))  # .../sglang
    found, files = {}, 0
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            files += 1
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            for token in ENGINE_NAME.findall(text):
                found.setdefault(token, os.path.relpath(path, os.path.dirname(root)))
    scanned = f"sglang.srt.environ's {len(registry)} names and {files} source files under {root}"
    return registry, deprecated, found, scanned


def judge_env(names, registry_target):
    if registry_target:
        registry, deprecated, found = set(load(registry_target)), set(), {}
        scanned = f"{registry_target} ({len(registry)} names)"
    else:
        registry, deprecated, found, scanned = sglang_env_names()
    known = sorted(registry | deprecated | set(found))
    verdicts = {}
    for name in names:
        if name in registry:
            read_in = "registry"
        elif name in deprecated:
            read_in = "deprecated"
        else:
            read_in = found.get(name, "")
        nearest = [] if read_in else difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        verdicts[name] = {"read_in": read_in, "nearest": nearest}
    return verdicts, scanned, known


def judge_backend(name):
    module = BACKEND_MODULES.get(name)
    if module is None:
        return {"module": "", "error": f"unknown transfer backend {name!r}"}
    if not module:
        return {"module": "", "error": ""}
    try:
        importlib.import_module(module)
    except Exception as e:  # an import that fails for any reason fails the KV manager the same way
        return {"module": module, "error": f"{type(e).__name__}: {e}"}
    return {"module": module, "error": ""}


def identity():
    """What ran where (an arm's provenance): the engine's version, the host's name, this python's, and the
    machine under the engine (torch, the CUDA it was built for, the GPUs and their driver) where there."""
    return {
        "sglang": sglang_version(),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        **torch_build(),
        **gpus(),
    }


def torch_build():
    """torch's version and the CUDA it was built for, read from its files (importing torch takes seconds)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return {}
    spec = importlib.util.find_spec("torch")
    cuda = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                found = re.search(r"^cuda(?:: [^=]+)? = '([^']*)'", f.read(), re.M)
        except OSError:
            continue
        cuda = found.group(1) if found else None
    return {"torch": version, "cuda": cuda}


def gpus():
    """The GPUs' names and the driver, as nvidia-smi says (nothing where it is not installed)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [[f.strip() for f in line.split(",")] for line in out.strip().splitlines() if line.strip()]
    names = sorted({r[0] for r in rows})
    return {
        "gpu": f"{len(rows)} x {', '.join(names)}" if rows else None,
        "driver": rows[0][-1] if rows else None,
    }


def main(request):
    if "parser" not in request:
        return identity()
    answer = {**identity(), "parser": "ok", "parser_detail": "", "argvs": [], "env": {}}
    answer["env_scanned"], answer["backends"] = "", {}
    try:
        parser = build_parser(request["parser"])
    except ModuleNotFoundError as e:
        top = request["parser"].split(":")[0].split(".")[0]
        if e.name != top and not request["parser"].startswith(f"{e.name}."):
            raise  # the engine is there but broken: an error, not a skip
        answer["parser"], answer["parser_detail"] = "absent", str(e)
        return answer
    backends = set()
    for flags in request["argvs"]:
        verdict, namespace = judge_flags(parser, flags)
        answer["argvs"].append(verdict)
        mode = getattr(namespace, "disaggregation_mode", None)
        if request.get("backends") and mode in ("prefill", "decode"):
            backends.add(getattr(namespace, "disaggregation_transfer_backend", None) or "mooncake")
    if request.get("env") or request.get("list_known"):
        answer["env"], answer["env_scanned"], known = judge_env(
            request.get("env") or [], request.get("registry")
        )
        if request.get("list_known"):
            answer["env_known"] = known
    answer["backends"] = {name: judge_backend(name) for name in sorted(backends)}
    return answer


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
