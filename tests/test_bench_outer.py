"""`agora bench outer`: the byte model of each averaging scheme, and a real run at the
smallest sizes whose measured bytes equal the model (real outer processes on loopback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.outer import bytes_model, main


def test_the_byte_model_is_flat_for_reduce_scatter_and_linear_for_all_gather() -> None:
    c = 1000.0
    for r in (2, 3, 4, 6, 8, 16, 64, 1024):
        rs, ag = bytes_model("reduce_scatter", r, c), bytes_model("all_gather", r, c)
        assert rs["sent"] == rs["received"] and ag["sent"] == ag["received"]
        assert ag["sent"] == (r - 1) * c
        assert rs["sent"] <= 2.03 * c  # each way, whatever the group size
    assert bytes_model("reduce_scatter", 2, c)["sent"] == c  # no audit below 3 members
    assert bytes_model("reduce_scatter", 3, c)["sent"] == pytest.approx(2 * 2 * c / 3 + 2 * c / 9)
    with pytest.raises(ValueError):
        bytes_model("butterfly", 3, c)


def test_a_real_run_measures_what_the_model_says(tmp_path: Path) -> None:
    out = tmp_path / "outer.json"
    assert (
        main(["--sizes", "2,3", "--numel", "6000", "--round-timeout", "10", "--json", str(out)])
        == 0
    )
    got = json.loads(out.read_text())
    rows = {(r["scheme"], r["members"]): r for r in got["measured"]}
    assert set(rows) == {(s, r) for s in ("reduce_scatter", "all_gather") for r in (2, 3)}
    for row in rows.values():  # every push arrived: the bytes are the model's, exactly
        assert row["sent_bytes"] == pytest.approx(row["model_sent_bytes"])
        assert row["received_bytes"] == pytest.approx(row["model_received_bytes"])
    assert got["model"][-1]["members"] == 64
    flat = got["bytes_per_replica_per_round"]
    assert flat["64"]["reduce_scatter"] < 4 * got["compressed_bytes"] < flat["4"]["all_gather"]
    measured = got["bytes_per_replica_per_round_measured"]
    assert measured["3"]["reduce_scatter"] == pytest.approx(
        rows[("reduce_scatter", 3)]["sent_bytes"] + rows[("reduce_scatter", 3)]["received_bytes"]
    )
