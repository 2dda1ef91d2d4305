"""`agora-node`'s command line: where the join token comes from (never only the command
line, which `ps` shows to every user of the machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.main import join_token, parse_args


def test_join_token_from_flag_file_or_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    env = {"AGORA_JOIN_TOKEN": "from-env"}
    assert join_token(parse_args(["--join-token", "flag"]), env) == "flag"
    assert join_token(parse_args(["--join-token-file", str(token_file)]), env) == "from-file"
    assert join_token(parse_args([]), env) == "from-env"
    assert join_token(parse_args([]), {}) is None  # the config file's, if any
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no token"):
        join_token(parse_args(["--join-token-file", str(tmp_path / "empty")]), env)
