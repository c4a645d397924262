"""The commands of docs/deploy.md, run as they are written there, so that the page and
`.env.example` cannot drift from what is tested. Each shell block the production smoke and
the settings tests run follows a `<!-- production-smoke: NAME -->` line in the page. Plain
Python (stdlib), shared by `scripts/production_smoke.py` and the web suite."""

import os
import pwd
import re
import subprocess
from pathlib import Path

from .servers import REPO_ROOT

DEPLOY_DOC = REPO_ROOT / "docs" / "deploy.md"
# A line of the page's commands that sets a variable for the reader to choose (`ACS_USER=acs`
# in §0, `ACS_ETC=/etc/acs` in §1, the health check's `SITE=` and `REPLICA=` in §8): the
# caller gives the values instead, and such a line is left out.
ASSIGNMENT = re.compile(r"^([A-Z_]+)=\S*\s*(#.*)?$")
# What a shell sets by itself, not the files it loaded.
_SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_"}


class DocCommandFailed(RuntimeError):
    pass


def doc_block(name: str) -> list[str]:
    """The lines of the fenced block that follows `<!-- production-smoke: NAME -->`."""
    text = DEPLOY_DOC.read_text()
    marker = f"<!-- production-smoke: {name} -->\n```"
    if marker not in text:
        raise DocCommandFailed(f"docs/deploy.md has no block marked production-smoke: {name}")
    block = text.split(marker, 1)[1].split("\n", 1)[1]
    return block.split("\n```", 1)[0].splitlines()


def _bash(script: str, *, env: dict, quiet: bool = True) -> str:
    """Run `script` with `bash -e` in the repository; its stdout. Fails on a non-zero exit
    or, when it should be `quiet`, on anything written to stderr (a line the shell could not
    parse or run)."""
    result = subprocess.run(
        ["bash", "-ec", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    if result.returncode != 0 or (quiet and result.stderr):
        raise DocCommandFailed(
            f"docs/deploy.md's commands failed ({result.returncode}):\n{script}\n{result.stderr}"
        )
    return result.stdout


def _script(name: str, variables: dict[str, str], skip=()) -> str:
    """Block `name` without the lines that set one of `variables` or contain a phrase of
    `skip`."""
    lines = [
        line
        for line in doc_block(name)
        if not ((match := ASSIGNMENT.match(line)) and match[1] in variables)
        and not any(phrase in line for phrase in skip)
    ]
    return "\n".join(lines)


def _variables(etc: Path, given: dict[str, str]) -> dict[str, str]:
    """ACS_ETC=`etc`, ACS_USER the user this process runs as, and `given`."""
    return {"ACS_ETC": str(etc), "ACS_USER": pwd.getpwuid(os.geteuid()).pw_name, **given}


def run_doc_block(
    name: str, *, etc: Path, env: dict | None = None, skip=(), quiet: bool = True, **given: str
) -> None:
    """Run block `name` of docs/deploy.md with ACS_ETC=`etc`, ACS_USER this process's user
    and the `given` variables (the block's own lines setting them are left out), in `env`
    (default: this process's), leaving out lines that contain a phrase of `skip`; see
    `_bash` for `quiet`."""
    variables = _variables(etc, given)
    _bash(_script(name, variables, skip), env={**(env or os.environ), **variables}, quiet=quiet)


def start_doc_command(
    name: str, *, etc: Path, env: dict, log, new_session: bool = False, **given: str
) -> subprocess.Popen:
    """Start block `name` of docs/deploy.md, one command, as `run_doc_block` would run it
    (with the `given` variables) but without waiting, its output to the file `log`. The
    command replaces its shell (exec), so that stopping the process stops it; in a session
    of its own if `new_session` (its process group then outlives its starter's)."""
    variables = _variables(etc, given)
    command = _script(name, variables)
    if "\n" in command:
        raise DocCommandFailed(f"docs/deploy.md's block {name} is not one command:\n{command}")
    return subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=REPO_ROOT,
        env={**env, **variables},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=new_session,
    )


def loaded_environment(etc: Path) -> dict[str, str]:
    """The variables that §2's `set -a; . …` line sets from the files in `etc`, loaded by a
    shell that starts with nothing but PATH."""
    base = {"PATH": os.environ["PATH"], "ACS_ETC": str(etc)}
    script = "\n".join(doc_block("load")) + "\nenv -0"
    variables = dict(
        item.split("=", 1) for item in _bash(script, env=base).split("\0") if "=" in item
    )
    return {
        name: value
        for name, value in variables.items()
        if name not in _SHELL_OWN and base.get(name) != value
    }


def production_environment(etc: Path) -> dict[str, str]:
    """§1 and §2 as written: the secrets generated and the production section of
    .env.example copied into `etc`, then loaded (no edits)."""
    run_doc_block("secrets", etc=etc)
    run_doc_block("environment", etc=etc)
    return loaded_environment(etc)
