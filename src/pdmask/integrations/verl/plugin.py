"""Entry-point target of the ``verl.plugins`` group: importing it registers pdmask with verl.

verl 0.9.1 (``verl/__init__.py``) runs ``entry_point.load()`` for every plugin, which
imports this module but calls nothing, so registration happens at import time.
"""

from . import register

register()
