"""tensorlane's network-namespace testbed: emulated hosts on a DSCP-trusting strict-priority switch.

See docs/testbed.md. Usage::

    from testbed import Testbed
    with Testbed(hosts=3, rate="200mbit", name="tl") as tb:
        tb.host(1).run(["ip", "addr"])
"""
from testbed.topology import CommandError, Host, Testbed, TestbedError, down_by_name, main, parse_rate

__all__ = ["CommandError", "Host", "Testbed", "TestbedError", "down_by_name", "main", "parse_rate"]
