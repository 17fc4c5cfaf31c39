"""astrai.dataset"""
