"""astrai.parallel"""
