"""A ledger damaged as a hand edit or another version's schema leaves it."""

import sqlite3

from infra.ledger import Ledger


def damage_ledger(path, statement: str) -> None:
    Ledger(path).close()
    db = sqlite3.connect(path)
    db.executescript(statement)
    db.commit()
    db.close()

