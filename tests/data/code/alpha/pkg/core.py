# A comment that no AST keeps.
def add_one(value):
    return value + 1


def countDown(n):
    """Count down to zero."""
    if n > 0:
        return countDown(n - 1)
    return "countDown done, countDowns left"


class Box:
    """A box."""

    def get_HTTPResponse(self, get_HTTPResponse=None):
        return self.get_HTTPResponse

    def __init__(self):
        self.items = []

    def test_thing(self):
        return 1

    class Inner:
        def _to_utf8(self, text):
            def helper(x):
                return x.encode("utf-8")
            return helper(text)
