"""The tooling's one error for the person at the keyboard."""


class UserError(Exception):
    """Something the person running the command can fix; printed as one sentence."""
