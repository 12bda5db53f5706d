"""How the deployment checks end: each problem on a FAIL line, then one summary line."""


def report_errors(errors, summary, failed=False):
    """Prints ``errors`` and ``summary``; the exit code: 1 when there is an error
    (or ``failed``: a problem the summary already names), else 0."""
    for e in errors:
        print(f"  FAIL {e}")
    print(f"  {summary}")
    return 1 if errors or failed else 0
