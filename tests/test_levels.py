"""Level -> DSCP -> switch queue table."""
import pytest

from tensorlane.policies.levels import dscp_table, parse_dscp, switch_queue


def test_default_table_uses_distinct_descending_queues():
    table = dscp_table(5)
    assert table == (46, 34, 26, 18, 10)
    assert [switch_queue(d) for d in table] == [5, 4, 3, 2, 1]


def test_names_and_numbers():
    assert parse_dscp("ef") == 46 and parse_dscp("AF41") == 34 and parse_dscp(8) == 8 and parse_dscp("26") == 26
    for bad in (64, -1, "XX", True, 1.5):
        with pytest.raises(ValueError):
            parse_dscp(bad)


def test_overrides_are_checked():
    assert dscp_table(2, {1: "CS1"}) == (46, 8)
    with pytest.raises(ValueError, match="reserved"):
        dscp_table(1, {0: "CS7"})
    with pytest.raises(ValueError, match="lower queue"):
        dscp_table(2, {0: "AF11", 1: "EF"})
