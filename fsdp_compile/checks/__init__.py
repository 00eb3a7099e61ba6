"""Checks that a run is what it should be: ranks that agree (:mod:`.agreement`), compiled
gradients that equal the eager runtime's (:mod:`.gradients`)."""
