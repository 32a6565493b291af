"""Ours: what a labeling session refuses, changing nothing (the server answers each kind with its HTTP status)."""


class LabelingError(ValueError):
    """A request the store refuses, changing nothing (the server answers each kind with its HTTP status)."""


class BadAnswer(LabelingError):
    """A value the session cannot take: a choice off the scale, a malformed labeler name or question id."""


class WrongLabeler(LabelingError):
    """A labeler not named in the session, or a wrong secret."""


class UnknownQuestion(LabelingError):
    """No question of the session has this id."""


class NotNow(LabelingError):
    """A request the session's state refuses: a second answer, a question not shown to this labeler, a closed
    session, nothing to undo."""
