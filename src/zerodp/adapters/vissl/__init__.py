"""VISSL: a zerodp engine from a VISSL config file. VISSL's config dialect itself is `zerodp.config.vissl`.

    vissl_engine.py     initialize: engine + VISSL's lr schedule from a VISSL config file
    vissl_optimizer.py  VISSL's optimizer and param groups rebuilt over a plain PyTorch model
"""
