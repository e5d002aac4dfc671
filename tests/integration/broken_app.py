"""An app module whose own code raises when it is imported."""

raise RuntimeError("this module cannot be imported")
