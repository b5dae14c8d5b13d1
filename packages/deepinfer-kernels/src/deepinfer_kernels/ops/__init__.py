"""The ops, one folder each: the public function (contract docstring) in ``__init__.py`` and the
plain-PyTorch definition of correct in ``reference.py``; GPU backends sit beside them."""
