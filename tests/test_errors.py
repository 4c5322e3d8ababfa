"""Error codes: each belongs to one class, and a reply carrying it comes back to the client as that class."""

from pdrt.client.error_codes import error_from_reply
from pdrt.errors import (
    AskTimeoutError,
    MailboxFullError,
    OverloadedError,
    PdrtError,
    RequestTimeoutError,
    ServerError,
    error_classes,
)
from pdrt.wire import Error


def subclasses(cls: type) -> list[type]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in subclasses(child))]


def test_every_code_belongs_to_the_one_class_that_defines_it_and_round_trips():
    classes = error_classes()
    defining = [cls for cls in subclasses(PdrtError) if "code" in vars(cls)]
    assert len({cls.code for cls in defining}) == len(defining), "two classes define one code"
    assert set(classes.values()) == set(defining)
    for code, cls in classes.items():
        exc = error_from_reply(Error(code, "why", "r1"))
        assert type(exc) is cls and exc.code == code and str(exc) == "why"
    assert classes["timeout"] is RequestTimeoutError and AskTimeoutError.code == "timeout"
    assert classes["overloaded"] is OverloadedError and MailboxFullError.code == "overloaded"
    novel = error_from_reply(Error("from_a_newer_server", "why"))
    assert isinstance(novel, ServerError) and novel.code == "from_a_newer_server"
