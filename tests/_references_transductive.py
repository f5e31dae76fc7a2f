"""Plain per-episode references of the transductive competitors.

One episode at a time, 2-D tensors (``z_s [Ns, D]``, ``y [Ns]``, ``z_q [Nq, D]``), loops over
classes and iterations written out, autograd + ``torch.optim.Adam`` where a method optimises. They
re-derive every formula from the papers (not from the batched code) so the batched solvers can be
checked against them. Each returns ``(log_probs [Nq, way], state dict)``.
"""

from __future__ import annotations

import torch


def _d2(a, b):
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


def _means(z, y, way):
    return torch.stack([z[y == k].mean(0) for k in range(way)])


def _unit(v):
    n = v.norm(dim=-1, keepdim=True)
    return torch.where(n > 1e-12, v / n.clamp_min(1e-12), torch.zeros_like(v))


def _cos(a, b):
    return _unit(a) @ _unit(b).T


# --------------------------------------------------------------------------------------------- TIM
def tim_gd(
    z_s, y, z_q, way, *, ce_weight, marginal_weight, conditional_weight, temperature, learn_temperature, lr, steps
):
    w = _means(z_s, y, way).clone().requires_grad_(True)
    t = torch.tensor(float(temperature), dtype=z_s.dtype, requires_grad=learn_temperature)
    params = [w] + ([t] if learn_temperature else [])
    opt = torch.optim.Adam(params, lr=lr)
    onehot = torch.eye(way, dtype=z_s.dtype)[y]
    for _ in range(steps):
        ls = -(t / 2) * _d2(z_s, w)
        lq = -(t / 2) * _d2(z_q, w)
        ce = -(onehot * torch.log_softmax(ls, 1)).sum(1).mean()
        p = torch.softmax(lq, 1)
        h_cond = -(p * torch.log(p + 1e-12)).sum(1).mean()
        pm = p.mean(0)
        h_marg = -(pm * torch.log(pm)).sum()
        loss = ce_weight * ce - (marginal_weight * h_marg - conditional_weight * h_cond)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.log_softmax(-(t / 2) * _d2(z_q, w), 1), {"prototypes": w.detach(), "scale": t.detach()}


def tim_adm(z_s, y, z_q, way, *, ce_weight, marginal_weight, conditional_weight, temperature, steps, alpha):
    n_s, n_q = len(z_s), len(z_q)
    w = _means(z_s, y, way)
    onehot = torch.eye(way, dtype=z_s.dtype)[y]
    q = None
    for _ in range(steps):
        p_q = torch.softmax(-(temperature / 2) * _d2(z_q, w), 1)
        a = 1 + conditional_weight
        b = marginal_weight / (marginal_weight + 1)
        q = p_q**a / (p_q**a).sum(0, keepdim=True) ** b
        q = q / q.sum(1, keepdim=True)
        p_s = torch.softmax(-(temperature / 2) * _d2(z_s, w), 1)
        cs = ce_weight / (1 + conditional_weight)
        cq = n_s / n_q
        new = torch.empty_like(w)
        for k in range(way):
            num = cs * (onehot[:, k] @ z_s + w[k] * p_s[:, k].sum() - p_s[:, k] @ z_s)
            num = num + cq * (q[:, k] @ z_q + w[k] * p_q[:, k].sum() - p_q[:, k] @ z_q)
            new[k] = num / (cs * onehot[:, k].sum() + cq * q[:, k].sum())
        w = w + alpha * (new - w)
    return torch.log_softmax(-(temperature / 2) * _d2(z_q, w), 1), {"prototypes": w, "assignments": q}


# --------------------------------------------------------------------------------- k-means family
def soft_kmeans(z_s, y, z_q, way, *, steps, scale, fix_support):
    p = _means(z_s, y, way)
    a_q = torch.softmax(-(scale / 2) * _d2(z_q, p), 1)
    for _ in range(steps):
        a_q = torch.softmax(-(scale / 2) * _d2(z_q, p), 1)
        a_s = torch.eye(way, dtype=z_s.dtype)[y] if fix_support else torch.softmax(-(scale / 2) * _d2(z_s, p), 1)
        p = torch.stack([(a_s[:, k] @ z_s + a_q[:, k] @ z_q) / (a_s[:, k].sum() + a_q[:, k].sum()) for k in range(way)])
    return torch.log_softmax(-(scale / 2) * _d2(z_q, p), 1), {"prototypes": p, "assignments": a_q}


def _kmeans(z_s, y, z_q, c, max_iter, fix_support):
    prev_q = None
    prev_s = y.clone() if fix_support else None
    iters = 0
    for _ in range(max_iter):
        lab_q = _d2(z_q, c).argmin(1)
        lab_s = y if fix_support else _d2(z_s, c).argmin(1)
        if prev_q is not None and torch.equal(lab_q, prev_q) and torch.equal(lab_s, prev_s):
            break
        new = c.clone()
        for k in range(len(c)):
            members = torch.cat([z_s[lab_s == k], z_q[lab_q == k]])
            if len(members):
                new[k] = members.mean(0)
        c, prev_q, prev_s = new, lab_q, lab_s
        iters += 1
    return c, prev_q, iters


def kmeans(z_s, y, z_q, way, *, max_iter, fix_support, scale):
    c, _, iters = _kmeans(z_s, y, z_q, _means(z_s, y, way), max_iter, fix_support)
    return torch.log_softmax(-(scale / 2) * _d2(z_q, c), 1), {"prototypes": c, "iterations": torch.tensor(iters)}


def _tafssl_space(z_s, z_q, reduced_dim, centre):
    if not (centre or reduced_dim > 0):
        return z_s, z_q
    z_s = _unit(z_s - z_s.mean(0))
    z_q = _unit(z_q - z_q.mean(0))
    if reduced_dim > 0:
        x = torch.cat([z_s, z_q])
        r = min(reduced_dim, x.shape[0], x.shape[1])
        # principal directions = top eigenvectors of x^T x
        evals, evecs = torch.linalg.eigh(x.T @ x)
        basis = evecs[:, torch.argsort(evals, descending=True)[:r]]
        z_s, z_q = _unit(z_s @ basis), _unit(z_q @ basis)
    return z_s, z_q


def bayes_kmeans(z_s, y, z_q, way, *, sigma, reduced_dim, centre, max_iter):
    z_s, z_q = _tafssl_space(z_s, z_q, reduced_dim, centre)
    c, cq, _ = _kmeans(z_s, y, z_q, _means(z_s, y, way), max_iter, fix_support=False)
    if cq is None:
        cq = _d2(z_q, c).argmin(1)
    p_cs = torch.softmax(-sigma * _d2(z_s, _unit(c)), 1)  # p(cluster | support)
    kern = torch.exp(-sigma * _d2(z_s, z_q))  # [Ns, Nq]
    out = torch.empty(len(z_q), way, dtype=z_s.dtype)
    for i in range(len(z_q)):
        weight = kern[:, i] * p_cs[:, cq[i]]
        for k in range(way):
            out[i, k] = weight[y == k].sum() / weight.sum()
    return torch.log(out), {"centres": c, "clusters": cq}


def mean_shift(z_s, y, z_q, way, *, steps, sigma, threshold, reduced_dim, centre):
    z_s, z_q = _tafssl_space(z_s, z_q, reduced_dim, centre)
    mu = _means(z_s, y, way)
    p = torch.softmax(-sigma * _d2(z_q, mu), 1)
    for _ in range(steps):
        ranked = [torch.sort(p[:, k], descending=True, stable=True) for k in range(way)]
        d = 0
        while d < len(z_q) and all(r.values[d] > threshold for r in ranked):
            d += 1
        mu = torch.stack([torch.cat([z_s[y == k], z_q[ranked[k].indices[:d]]]).mean(0) for k in range(way)])
        p = torch.softmax(-sigma * _d2(z_q, mu), 1)
    return torch.log(p), {"prototypes": mu}


# ------------------------------------------------------------------------------ pseudo-labelling
def can_t(z_s, y, z_q, way, *, step, iterations, scale):
    n_iter = len(z_q) // step if iterations < 0 else iterations
    p = _unit(_means(z_s, y, way))
    for i in range(n_iter):
        prob = torch.softmax(scale * _cos(z_q, p), 1)
        conf, pseudo = prob.max(1)
        top = torch.argsort(conf, descending=True)[: min((i + 1) * step, len(z_q))]
        p = _unit(torch.stack([torch.cat([z_s[y == k], z_q[top][pseudo[top] == k]]).mean(0) for k in range(way)]))
    return torch.log_softmax(scale * _cos(z_q, p), 1), {"prototypes": p}


def _rectify(z_s, y, z_q, way, epsilon, shift):
    if shift:
        z_q = z_q + (z_s.mean(0) - z_q.mean(0))
    base = _means(z_s, y, way)
    pseudo = _cos(z_q, base).argmax(1)
    protos = []
    for k in range(way):
        members = torch.cat([z_s[y == k], z_q[pseudo == k]])
        weights = torch.softmax(epsilon * _cos(members, base[k : k + 1])[:, 0], 0)
        protos.append(weights @ members)
    return torch.stack(protos), z_q


def bd_cspn(z_s, y, z_q, way, *, epsilon, shift):
    p, z_q = _rectify(z_s, y, z_q, way, epsilon, shift)
    return torch.log_softmax(epsilon * _cos(z_q, p), 1), {"prototypes": p}


def _released_rectify(z_s, y, z_q, way, epsilon):
    # imtiazziko/LaplacianShot metric_class_type with proto_rect: every point re-predicted, weights
    # a softmax over classes, plain mean over the members, empty classes dropped
    z_q = z_q + (z_s.mean(0) - z_q.mean(0))
    x = torch.cat([z_s, z_q])
    base = _means(z_s, y, way)
    cos = _cos(x, base)
    pred = cos.argmax(1)
    weights = torch.softmax(epsilon * cos, 1)
    kept = [k for k in range(way) if (pred == k).any()]
    protos = torch.stack([(weights[pred == k, k][:, None] * x[pred == k]).mean(0) for k in kept])
    return protos, kept, z_q


def laplacianshot(
    z_s,
    y,
    z_q,
    way,
    *,
    knn,
    lmd,
    steps,
    tol,
    rectify,
    epsilon,
    preset,
    self_neighbour,
    released_rectification,
    shifted_unary,
):
    official = preset == "official"
    self_nb, released, shifted = [
        official if v is None else v for v in (self_neighbour, released_rectification, shifted_unary)
    ]
    kept = list(range(way))
    if rectify and released:
        m, kept, z_shift = _released_rectify(z_s, y, z_q, way, epsilon)
    elif rectify:
        m, z_shift = _rectify(z_s, y, z_q, way, epsilon, True)
    else:
        m, z_shift = _means(z_s, y, way), z_q
    z_u = z_shift if (shifted and rectify) else z_q
    unary = _d2(z_u, m)  # [Nq, len(kept)]
    n = len(z_q)
    w = torch.zeros(n, n, dtype=z_q.dtype)
    k = min(knn - 1 if self_nb else knn, n - 1)
    dist = _d2(z_q, z_q).sqrt()
    for i in range(n):
        others = [j for j in torch.argsort(dist[i]).tolist() if j != i]
        for j in others[:k]:
            w[i, j] = 1.0
    y_ = torch.softmax(-unary, 1)
    logits = -unary
    old = None
    iters = 0
    for i in range(steps):
        logits = -unary + lmd * (w @ y_)
        y_ = torch.softmax(logits, 1)
        iters += 1
        e = (unary * y_ - lmd * (w @ y_) * y_ + y_ * torch.log(y_.clamp_min(1e-20))).sum()
        if i > 1 and abs(e - old) <= tol * abs(old):
            break
        old = e
    if rectify and released:
        # the shortened prototype list: column j is the j-th kept class, labels past it get nothing
        probs = torch.zeros(n, way, dtype=z_q.dtype)
        probs[:, : len(kept)] = y_
        lp = torch.log_softmax(torch.log(probs.clamp_min(1e-30)), 1)
        full = torch.zeros(way, z_s.shape[1], dtype=z_s.dtype)
        full[kept] = m
        return lp, {"prototypes": full, "iterations": torch.tensor(iters)}
    return torch.log_softmax(logits, 1), {"prototypes": m, "iterations": torch.tensor(iters)}


# -------------------------------------------------------------------------------- entropy / OT
def entropy_min(z_s, y, z_q, way, *, steps, lr, entropy_weight, scale):
    w = _means(z_s, y, way).clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=lr)
    for _ in range(steps):
        ce = torch.nn.functional.cross_entropy(-(scale / 2) * _d2(z_s, w), y)
        p = torch.softmax(-(scale / 2) * _d2(z_q, w), 1)
        ent = -(p * torch.log(p)).sum(1).mean()
        loss = ce + entropy_weight * ent
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.log_softmax(-(scale / 2) * _d2(z_q, w), 1), {"prototypes": w.detach()}


def pt_map(z_s, y, z_q, way, *, beta, lam, alpha, steps, sinkhorn_tol, sinkhorn_max_iter):
    def pt(x):
        return torch.sign(x) * (x.abs() + 1e-6) ** beta + (x == 0).double() * 1e-6**beta

    z_s, z_q = _unit(pt(z_s)), _unit(pt(z_q))
    z_s, z_q = _unit(z_s - z_s.mean(0)), _unit(z_q - z_q.mean(0))
    n_q = len(z_q)

    def plan_of(mu):
        p = torch.exp(-lam * _d2(z_q, mu))
        p = p / p.sum()
        u = torch.zeros(n_q, dtype=p.dtype)
        for _ in range(sinkhorn_max_iter):
            if (u - p.sum(1)).abs().max() <= sinkhorn_tol:
                break
            u = p.sum(1)
            p = p / u[:, None]
            p = p * ((n_q / way) / p.sum(0))[None, :]
        return p

    mu = _means(z_s, y, way)
    onehot = torch.eye(way, dtype=z_s.dtype)[y]
    for _ in range(steps):
        p = plan_of(mu)
        est = torch.stack(
            [(onehot[:, k] @ z_s + p[:, k] @ z_q) / (onehot[:, k].sum() + p[:, k].sum()) for k in range(way)]
        )
        mu = mu + alpha * (est - mu)
    p = plan_of(mu)
    return torch.log(p / p.sum(1, keepdim=True)), {"prototypes": mu, "assignments": p}


# ------------------------------------------------------------------ realistic-query competitors
def alpha_tim(z_s, y, z_q, way, *, alpha, ce_weight, marginal_weight, conditional_weight, temperature, lr, steps):
    shot = len(y) // way
    a = alpha if alpha > 0 else (2.0 if shot == 1 else 7.0 if shot >= 5 else 5.0)
    w = _means(z_s, y, way).clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=lr)
    onehot = torch.eye(way, dtype=z_s.dtype)[y]
    for _ in range(steps):
        ce = -(onehot * torch.log_softmax(-(temperature / 2) * _d2(z_s, w), 1)).sum(1).mean()
        p = torch.softmax(-(temperature / 2) * _d2(z_q, w), 1)
        h_marg = (1 - (p.mean(0) ** a).sum()) / (a - 1)
        h_cond = ((1 - ((p + 1e-12) ** a).sum(1)) / (a - 1)).mean()
        loss = ce_weight * ce - (marginal_weight * h_marg - conditional_weight * h_cond)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.log_softmax(-(temperature / 2) * _d2(z_q, w), 1), {"prototypes": w.detach()}


def paddle(z_s, y, z_q, way, *, lmd, steps, scale_features):
    if scale_features:
        lo, hi = z_q.min(0).values, z_q.max(0).values
        rng = torch.where(hi - lo == 0, torch.ones_like(lo), hi - lo)
        z_s, z_q = (z_s - lo) / rng, (z_q - lo) / rng
    n_q = len(z_q)
    lam = lmd if lmd > 0 else n_q
    w = _means(z_s, y, way)
    v = torch.zeros(way, dtype=z_q.dtype)
    onehot = torch.eye(way, dtype=z_s.dtype)[y]
    for _ in range(steps):
        u = torch.softmax(-0.5 * _d2(z_q, w) + lam * v / n_q, 1)
        v = torch.log(u.mean(0) + 1e-6) + 1
        w = torch.stack(
            [(u[:, k] @ z_q + onehot[:, k] @ z_s) / (u[:, k].sum() + onehot[:, k].sum()) for k in range(way)]
        )
    return torch.log(u / u.sum(1, keepdim=True)), {"prototypes": w, "assignments": u}


def _pt(x, beta):
    return torch.sign(x) * (x.abs() + 1e-6) ** beta + (x == 0).double() * 1e-6**beta


def bms(z_s, y, z_q, way, *, power, lam, steps, sinkhorn_iter, epochs, lr, momentum):
    n_s = len(z_s)
    z = _unit(_pt(torch.cat([z_s, z_q]), power))
    z = _unit(z - z.mean(0))
    onehot = torch.eye(way, dtype=z.dtype)[y]
    mu = _unit(_means(z[:n_s], y, way))
    min_size = float(n_s // way)
    for _ in range(steps):
        q = torch.softmax(lam * z[n_s:] @ mu.T, 1)
        for _ in range(sinkhorn_iter):
            q = q / q.sum(1, keepdim=True)
            for k in range(way):
                if q[:, k].sum() < min_size:
                    q[:, k] = q[:, k] / ((q[:, k] + 1e-20).sum() / min_size)
        wm = torch.cat([onehot, q])
        labels = wm.argmax(1)
        min_size = float(min((labels == k).sum() for k in range(way)))
        mu = _unit(torch.stack([wm[:, k] @ z / wm[:, k].sum() for k in range(way)]))
        if epochs > 0:
            w = mu.clone().requires_grad_(True)
            s = torch.ones((), dtype=z.dtype, requires_grad=True)
            opt = torch.optim.SGD([w, s], lr=lr, momentum=momentum)
            for _ in range(epochs):
                out = torch.log_softmax(s * z @ _unit(w).T, 1)
                loss = -(out * wm).sum(1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    w /= w.norm(dim=1, keepdim=True)
            mu = w.detach()
    return torch.log(q / q.sum(1, keepdim=True)), {"prototypes": mu, "assignments": q}


def _sinkhorn_plan(cost, lam, col, tol, max_iter):
    p = torch.exp(-lam * cost)
    p = p / p.sum()
    u = torch.zeros(len(p), dtype=p.dtype)
    for _ in range(max_iter):
        if (u - p.sum(1)).abs().max() <= tol:
            break
        u = p.sum(1)
        p = p / u[:, None]
        p = p * (col / p.sum(0))[None, :]
    return p


def proto_lp(
    z_s,
    y,
    z_q,
    way,
    *,
    power,
    reduced_dim,
    lam,
    alpha,
    gamma,
    mix,
    steps,
    balanced,
    sinkhorn_tol,
    lp_tol,
    sinkhorn_max_iter,
):
    n_s, n_q = len(z_s), len(z_q)
    x = _unit(_pt(torch.cat([z_s, z_q]), power))
    if reduced_dim > 0:
        # top right singular vectors of the uncentred samples
        _, _, vh = torch.linalg.svd(x, full_matrices=False)
        x = x @ vh[: min(reduced_dim, *x.shape)].T
    x = _unit(x - x.mean(0))
    onehot = torch.eye(way, dtype=x.dtype)[y]
    mu = _unit(_means(x[:n_s], y, way))

    def assign(mu):
        cost = _d2(x[n_s:], mu)
        if balanced:
            return _sinkhorn_plan(cost, lam, n_q / way, sinkhorn_tol, sinkhorn_max_iter)
        return torch.softmax(-lam * cost, 1)

    for _ in range(steps):
        z = torch.cat([onehot, assign(mu)])
        delta = z.sum(0)
        w = z.T @ (z / delta[None, :])
        m = onehot.T @ onehot + gamma * (torch.eye(way, dtype=x.dtype) - w)
        m = torch.tril(m) + torch.tril(m, -1).T  # the lower triangle, as a Cholesky reads it
        a = torch.linalg.solve(m, onehot.T @ onehot)
        p = z @ a
        if balanced:
            u = torch.zeros(len(p), dtype=p.dtype)
            for _ in range(sinkhorn_max_iter):
                if (u - p.sum(1)).abs().max() <= lp_tol:
                    break
                u = p.sum(1)
                p = p / u[:, None]
                p = p * ((n_s + n_q) / way / p.sum(0))[None, :]
                p[:n_s] = onehot
        else:
            p = p / p.sum(1, keepdim=True)
            p[:n_s] = onehot
        mask = (mix * p + (1 - mix) * z).clamp(0, 1)
        est = torch.stack([mask[:, k] @ x / mask[:, k].sum() for k in range(way)])
        mu = mu + alpha * (est - mu)
    plan = assign(mu)
    return torch.log(plan / plan.sum(1, keepdim=True)), {"prototypes": mu, "assignments": plan}


REFERENCES = {
    "tim-gd": tim_gd,
    "tim-adm": tim_adm,
    "soft-kmeans": soft_kmeans,
    "kmeans": kmeans,
    "bayes-kmeans": bayes_kmeans,
    "mean-shift": mean_shift,
    "can-t": can_t,
    "bd-cspn": bd_cspn,
    "laplacianshot": laplacianshot,
    "entropy-min": entropy_min,
    "pt-map": pt_map,
    "alpha-tim": alpha_tim,
    "paddle": paddle,
    "bms": bms,
    "proto-lp": proto_lp,
}
