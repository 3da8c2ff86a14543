"""``dsh-pipeline completion bash|zsh``: a shell completion script generated from the parser.

Every command, its actions (``topics ensure``, ``schemas check``) and its options come from
the same parser ``--help`` shows, so the script is never out of step with the code. Install::

    dsh-pipeline completion bash > ~/.local/share/bash-completion/completions/dsh-pipeline
    dsh-pipeline completion zsh > "${fpath[1]}/_dsh-pipeline"    # or: source <(...)
"""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "completion", help="print a shell completion script (bash, zsh)", description=__doc__)
    parser.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete in")
    parser.set_defaults(func=run, uses_settings=False)


def words_of(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """``"command [action]"`` -> what may follow it (its actions and options); "" -> the
    commands and the top-level options."""
    table: dict[str, list[str]] = {}

    def walk(current: argparse.ArgumentParser, path: str) -> None:
        words: list[str] = []
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    words.append(name)
                    walk(child, f"{path} {name}".strip())
            elif action.help != argparse.SUPPRESS:
                words.extend(action.option_strings)
        table[path] = words

    walk(parser, "")
    return table


def bash_script(table: dict[str, list[str]]) -> str:
    cases = "\n".join(f'        "{path}") words="{" ".join(words)}" ;;'
                      for path, words in sorted(table.items()) if path)
    return f'''# bash completion for dsh-pipeline (generated: dsh-pipeline completion bash)
_dsh_pipeline() {{
    local cur path="" word words i
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${{COMP_WORDS[i]}}"
        [[ "$word" == -* ]] && continue
        case "${{path:+$path }}$word" in
{_known_paths(table)}) path="${{path:+$path }}$word" ;;
        esac
    done
    case "$path" in
        "") words="{" ".join(table[""])}" ;;
{cases}
    esac
    if [[ "$cur" == -* || -n "$words" ]]; then
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
    fi
    [[ ${{#COMPREPLY[@]}} -eq 0 ]] && COMPREPLY=($(compgen -f -- "$cur"))
    return 0
}}
complete -F _dsh_pipeline dsh-pipeline
'''


def _known_paths(table: dict[str, list[str]]) -> str:
    return "            " + "|".join(f'"{path}"' for path in sorted(table) if path)


def zsh_script(table: dict[str, list[str]]) -> str:
    return ("#compdef dsh-pipeline\n# zsh completion for dsh-pipeline (generated: "
            "dsh-pipeline completion zsh)\nautoload -U +X bashcompinit && bashcompinit\n"
            + bash_script(table).split("\n", 1)[1])


def run(args: argparse.Namespace, settings: Settings) -> int:
    from pipeline.cli.main import build_parser
    table = words_of(build_parser(""))
    print(bash_script(table) if args.shell == "bash" else zsh_script(table), end="")
    return 0
